"""shardmqctl: operate a ShardMQ node over its management HTTP API, in the spirit of rabbitmqctl/lavinmqctl.

Credentials and the API address come from flags (``--url``, ``--username``, ``--password``), else the
environment (``SHARDMQCTL_URL``, ``SHARDMQCTL_USERNAME``, ``SHARDMQCTL_PASSWORD``), else
``~/.shardmqctl.ini`` (section ``[shardmqctl]``: ``url``, ``username``, ``password``; ``--config FILE``
reads another file), else ``http://127.0.0.1:15672`` and guest/guest.

Output is a table by default, ``--format json`` prints the API's JSON. Exit status: 0 on success,
1 when the node refuses or cannot be reached (the reason goes to stderr), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import base64
import configparser
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_URL = "http://127.0.0.1:15672"
CONFIG_SECTION = "shardmqctl"


class CtlError(Exception):
    """A refusal or an unreachable node: exit status 1."""


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class Client:
    def __init__(self, url: str, username: str, password: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.auth = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            req.add_header(key, value)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                reason = json.loads(raw).get("reason") or raw.decode()
            except (ValueError, AttributeError):
                reason = raw.decode("utf-8", "replace")
            raise CtlError(f"{method} {path}: {exc.code} {reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CtlError(f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}") from None
        return json.loads(raw) if raw.strip() else None

    def list_all(self, path: str) -> list:
        """Every item of a list endpoint, page by page (so 100,000 queues are not one answer)."""
        items: list = []
        page = 1
        sep = "&" if "?" in path else "?"
        while True:
            data = self.call("GET", f"{path}{sep}page={page}&page_size=500")
            items += data["items"]
            if page >= data["page_count"]:
                return items
            page += 1


# ------------------------------------------------------------------------- output
def _cell(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _get(item: dict, column: str) -> Any:
    cur: Any = item
    for part in column.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def render(rows: list[dict], columns: Sequence[str], fmt: str, out: Any = sys.stdout) -> None:
    if fmt == "json":
        json.dump([{c: _get(r, c) for c in columns} for r in rows], out, indent=2, sort_keys=False)
        out.write("\n")
        return
    table = [list(columns)] + [[_cell(_get(r, c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")


def done(args: argparse.Namespace, message: str, data: Any = None) -> None:
    if args.format == "json":
        json.dump({"ok": True, "message": message, **({"result": data} if data is not None else {})}, sys.stdout)
        sys.stdout.write("\n")
    elif not args.quiet:
        print(message)


# ------------------------------------------------------------------------ commands
def _vhost_path(args: argparse.Namespace) -> str:
    return _q(args.vhost)


def _lister(path: Callable[[argparse.Namespace], str], default_columns: Sequence[str], paged: bool = True):
    def run(client: Client, args: argparse.Namespace) -> None:
        p = path(args)
        rows = client.list_all(p) if paged else client.call("GET", p)
        render(rows, args.columns or list(default_columns), args.format)
    return run


def cmd_status(client: Client, args: argparse.Namespace) -> None:
    ov = client.call("GET", "/api/overview")
    if args.format == "json":
        json.dump(ov, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    totals = ov.get("object_totals", {})
    qt = ov.get("queue_totals", {})
    lines = [("node", ov.get("node")), ("product", f"{ov.get('product_name')} (API {ov.get('management_version')})"),
             ("connections", totals.get("connections")), ("channels", totals.get("channels")),
             ("queues", totals.get("queues")), ("exchanges", totals.get("exchanges")),
             ("consumers", totals.get("consumers")), ("messages", qt.get("messages")),
             ("messages_ready", qt.get("messages_ready")),
             ("messages_unacknowledged", qt.get("messages_unacknowledged")),
             ("alarms", ", ".join(ov.get("alarms", [])) or "none")]
    for key, value in lines:
        print(f"{key + ':':<26}{value}")


def cmd_close_connection(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/connections/{_q(args.name)}", headers={"X-Reason": args.reason})
    done(args, f"Closing connection {args.name}")


def cmd_purge_queue(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/queues/{_vhost_path(args)}/{_q(args.queue)}/contents")
    done(args, f"Purged queue '{args.queue}' in vhost '{args.vhost}'")


def cmd_delete_queue(client: Client, args: argparse.Namespace) -> None:
    query = "&".join(f"{k}=true" for k, on in (("if-empty", args.if_empty), ("if-unused", args.if_unused)) if on)
    client.call("DELETE", f"/api/queues/{_vhost_path(args)}/{_q(args.queue)}" + (f"?{query}" if query else ""))
    done(args, f"Deleted queue '{args.queue}' in vhost '{args.vhost}'")


def cmd_add_vhost(client: Client, args: argparse.Namespace) -> None:
    body = {"description": args.description} if args.description else {}
    client.call("PUT", f"/api/vhosts/{_q(args.name)}", body)
    done(args, f"Added vhost '{args.name}'")


def cmd_delete_vhost(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/vhosts/{_q(args.name)}")
    done(args, f"Deleted vhost '{args.name}'")


def cmd_add_user(client: Client, args: argparse.Namespace) -> None:
    existing = _exists(client, f"/api/users/{_q(args.user)}")
    if existing:
        raise CtlError(f"user '{args.user}' already exists")
    client.call("PUT", f"/api/users/{_q(args.user)}", {"password": args.new_password, "tags": ",".join(args.tags)})
    done(args, f"Added user '{args.user}'")


def _exists(client: Client, path: str) -> bool:
    try:
        client.call("GET", path)
        return True
    except CtlError as exc:
        if ": 404 " in str(exc):
            return False
        raise


def cmd_delete_user(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/users/{_q(args.user)}")
    done(args, f"Deleted user '{args.user}'")


def cmd_change_password(client: Client, args: argparse.Namespace) -> None:
    user = client.call("GET", f"/api/users/{_q(args.user)}")
    client.call("PUT", f"/api/users/{_q(args.user)}", {"password": args.new_password, "tags": user.get("tags", [])})
    done(args, f"Changed the password of user '{args.user}'")


def cmd_set_user_tags(client: Client, args: argparse.Namespace) -> None:
    user = client.call("GET", f"/api/users/{_q(args.user)}")
    client.call("PUT", f"/api/users/{_q(args.user)}", {"password_hash": user["password_hash"],
                                                     "hashing_algorithm": user["hashing_algorithm"],
                                                     "tags": list(args.tags)})
    done(args, f"Set the tags of user '{args.user}' to {list(args.tags)}")


def cmd_set_permissions(client: Client, args: argparse.Namespace) -> None:
    client.call("PUT", f"/api/permissions/{_vhost_path(args)}/{_q(args.user)}",
                {"configure": args.configure, "write": args.write, "read": args.read})
    done(args, f"Set permissions of user '{args.user}' in vhost '{args.vhost}'")


def cmd_clear_permissions(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/permissions/{_vhost_path(args)}/{_q(args.user)}")
    done(args, f"Cleared permissions of user '{args.user}' in vhost '{args.vhost}'")


def cmd_set_policy(client: Client, args: argparse.Namespace) -> None:
    try:
        definition = json.loads(args.definition)
    except ValueError as exc:
        raise CtlError(f"DEFINITION is not JSON: {exc}") from None
    client.call("PUT", f"/api/policies/{_vhost_path(args)}/{_q(args.name)}",
                {"pattern": args.pattern, "definition": definition, "priority": args.priority,
                 "apply-to": args.apply_to})
    done(args, f"Set policy '{args.name}' in vhost '{args.vhost}'")


def cmd_clear_policy(client: Client, args: argparse.Namespace) -> None:
    client.call("DELETE", f"/api/policies/{_vhost_path(args)}/{_q(args.name)}")
    done(args, f"Cleared policy '{args.name}' in vhost '{args.vhost}'")


def cmd_set_vhost_limits(client: Client, args: argparse.Namespace) -> None:
    try:
        limits = json.loads(args.limits)
    except ValueError as exc:
        raise CtlError(f"LIMITS is not JSON: {exc}") from None
    if not isinstance(limits, dict):
        raise CtlError('LIMITS must be a JSON object, e.g. {"max-connections": 100}')
    for name, value in limits.items():
        if isinstance(value, int) and value < 0:
            if _exists(client, f"/api/vhost-limits/{_vhost_path(args)}"):
                try:
                    client.call("DELETE", f"/api/vhost-limits/{_vhost_path(args)}/{_q(name)}")
                except CtlError as exc:
                    if ": 404 " not in str(exc):
                        raise
        else:
            client.call("PUT", f"/api/vhost-limits/{_vhost_path(args)}/{_q(name)}", {"value": value})
    done(args, f"Set limits of vhost '{args.vhost}'")


def cmd_export_definitions(client: Client, args: argparse.Namespace) -> None:
    data = client.call("GET", "/api/definitions")
    text = json.dumps(data, indent=2) + "\n"
    if args.file == "-":
        sys.stdout.write(text)
        return
    with open(args.file, "w", encoding="utf-8") as fh:
        fh.write(text)
    done(args, f"Exported definitions to {args.file}")


def cmd_import_definitions(client: Client, args: argparse.Namespace) -> None:
    try:
        with open(args.file, encoding="utf-8") if args.file != "-" else sys.stdin as fh:
            data = json.load(fh)
    except OSError as exc:
        raise CtlError(f"cannot read {args.file}: {exc.strerror}") from None
    except ValueError as exc:
        raise CtlError(f"{args.file} is not JSON: {exc}") from None
    client.call("POST", "/api/definitions", data)
    done(args, f"Imported definitions from {args.file}")


# ------------------------------------------------------------------------ parsing
def _common(defaults: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. The copy given to the commands
    has no defaults, so `shardmqctl -p v list_queues` keeps the -p given before the command."""
    def d(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=d(None),
                        help=f"management API base URL (env SHARDMQCTL_URL; default {DEFAULT_URL})")
    common.add_argument("--username", "-u", default=d(None), help="API user (env SHARDMQCTL_USERNAME; default guest)")
    common.add_argument("--password", default=d(None), help="API password (env SHARDMQCTL_PASSWORD; default guest)")
    common.add_argument("--config", default=d(None), help="INI file with a [shardmqctl] section "
                                                          "(default ~/.shardmqctl.ini)")
    common.add_argument("--format", choices=("table", "json"), default=d("table"), help="output format")
    common.add_argument("--quiet", "-q", action="store_true", default=d(False), help="no confirmation messages")
    common.add_argument("--vhost", "-p", default=d("/"), help="virtual host (default /)")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common(defaults=False)
    parser = argparse.ArgumentParser(prog="shardmqctl", parents=[_common(defaults=True)],
                                     description="Operate a ShardMQ node over its management HTTP API.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Callable, help_text: str, **kw: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text, **kw)
        p.set_defaults(func=func, columns=None)
        return p

    add("status", cmd_status, "overview of the node: totals and alarms")
    listings = {
        "list_queues": (lambda a: f"/api/queues/{_vhost_path(a)}", ["name", "messages", "consumers"]),
        "list_exchanges": (lambda a: f"/api/exchanges/{_vhost_path(a)}", ["name", "type"]),
        "list_bindings": (lambda a: f"/api/bindings/{_vhost_path(a)}",
                          ["source", "destination", "destination_type", "routing_key"]),
        "list_connections": (lambda a: "/api/connections", ["name", "user", "vhost", "channels", "state"]),
        "list_vhosts": (lambda a: "/api/vhosts", ["name", "description", "messages"]),
        "list_users": (lambda a: "/api/users", ["name", "tags"]),
        "list_policies": (lambda a: f"/api/policies/{_vhost_path(a)}",
                          ["vhost", "name", "pattern", "apply-to", "definition", "priority"]),
    }
    for name, (path, columns) in listings.items():
        p = add(name, _lister(path, columns), f"list ({', '.join(columns)} by default; name other columns)")
        p.add_argument("columns", nargs="*", help="columns to show (dotted for nested fields)")
    for name, (path, columns) in {
        "list_consumers": (lambda a: f"/api/consumers/{_vhost_path(a)}",
                           ["queue.name", "channel_details.connection_name", "consumer_tag", "ack_required",
                            "prefetch_count"]),
        "list_permissions": (lambda a: f"/api/vhosts/{_vhost_path(a)}/permissions",
                             ["user", "configure", "write", "read"]),
    }.items():
        p = add(name, _lister(path, columns, paged=False), f"list ({', '.join(columns)} by default)")
        p.add_argument("columns", nargs="*", help="columns to show")
    p = add("close_connection", cmd_close_connection, "close a client connection by name (see list_connections)")
    p.add_argument("name")
    p.add_argument("reason", nargs="?", default="Closed via shardmqctl")
    p = add("purge_queue", cmd_purge_queue, "remove every ready message of a queue")
    p.add_argument("queue")
    p = add("delete_queue", cmd_delete_queue, "delete a queue")
    p.add_argument("queue")
    p.add_argument("--if-empty", action="store_true")
    p.add_argument("--if-unused", action="store_true")
    p = add("add_vhost", cmd_add_vhost, "create a virtual host")
    p.add_argument("name")
    p.add_argument("--description", default="")
    p = add("delete_vhost", cmd_delete_vhost, "delete a virtual host with its queues, exchanges and their data")
    p.add_argument("name")
    p = add("add_user", cmd_add_user, "create a user")
    p.add_argument("user")
    p.add_argument("new_password", metavar="password")
    p.add_argument("--tags", nargs="*", default=[])
    p = add("delete_user", cmd_delete_user, "delete a user (closes its connections)")
    p.add_argument("user")
    p = add("change_password", cmd_change_password, "set a user's password (closes its connections)")
    p.add_argument("user")
    p.add_argument("new_password", metavar="password")
    p = add("set_user_tags", cmd_set_user_tags, "replace a user's tags")
    p.add_argument("user")
    p.add_argument("tags", nargs="*")
    p = add("set_permissions", cmd_set_permissions, "set a user's configure/write/read patterns on a vhost")
    for name in ("user", "configure", "write", "read"):
        p.add_argument(name)
    p = add("clear_permissions", cmd_clear_permissions, "remove a user's permissions on a vhost")
    p.add_argument("user")
    p = add("set_policy", cmd_set_policy, "set a policy")
    p.add_argument("name")
    p.add_argument("pattern")
    p.add_argument("definition", help='JSON, e.g. {"max-length": 1000}')
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--apply-to", default="all", choices=("all", "queues", "exchanges"))
    p = add("clear_policy", cmd_clear_policy, "remove a policy")
    p.add_argument("name")
    p = add("set_vhost_limits", cmd_set_vhost_limits, "set vhost limits (a negative value removes one)")
    p.add_argument("limits", help='JSON, e.g. {"max-connections": 100, "max-queues": -1}')
    p = add("export_definitions", cmd_export_definitions, "write the definitions (RabbitMQ's JSON) to FILE (- = stdout)")
    p.add_argument("file")
    p = add("import_definitions", cmd_import_definitions, "merge the definitions in FILE (- = stdin)")
    p.add_argument("file")
    return parser


def resolve_credentials(args: argparse.Namespace, env: dict[str, str]) -> tuple[str, str, str]:
    """(url, username, password): flags, then env, then the INI file, then the defaults."""
    ini: dict[str, str] = {}
    path = args.config or os.path.join(os.path.expanduser("~"), ".shardmqctl.ini")
    if args.config and not os.path.exists(path):
        raise CtlError(f"--config {path}: no such file")
    if os.path.exists(path):
        cp = configparser.ConfigParser()
        try:
            cp.read(path, encoding="utf-8")
        except configparser.Error as exc:
            raise CtlError(f"{path}: {exc}") from None
        if cp.has_section(CONFIG_SECTION):
            ini = dict(cp.items(CONFIG_SECTION))

    def pick(flag: str | None, env_key: str, ini_key: str, default: str) -> str:
        for value in (flag, env.get(env_key), ini.get(ini_key)):
            if value:
                return value
        return default

    return (pick(args.url, "SHARDMQCTL_URL", "url", DEFAULT_URL),
            pick(args.username, "SHARDMQCTL_USERNAME", "username", "guest"),
            pick(args.password, "SHARDMQCTL_PASSWORD", "password", "guest"))


def main(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error, naming the bad argument
    try:
        url, user, password = resolve_credentials(args, dict(os.environ) if env is None else env)
        args.func(Client(url, user, password), args)
    except CtlError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
