"""Entry point of a frontend process: `python -m frontend.main --index K --run-dir DIR`."""

from __future__ import annotations

from broker.process import run_worker


def _worker_class():
    from frontend.worker import FrontendWorker

    return FrontendWorker


def main(argv: list[str] | None = None) -> int:
    return run_worker("frontend", argv, _worker_class)


if __name__ == "__main__":
    raise SystemExit(main())
