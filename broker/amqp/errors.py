"""Exceptions carrying an AMQP reply code, raised by the parts that decide a protocol error."""

from __future__ import annotations

from broker.amqp.constants import REPLY_TEXT


class AMQPError(Exception):
    """A protocol error with the reply code, text and the offending method's ids."""

    def __init__(self, code: int, text: str, class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(code, text, class_id, method_id)
        self.code = code
        self.text = text
        self.class_id = class_id
        self.method_id = method_id

    @property
    def reply_text(self) -> str:
        """Text as RabbitMQ sends it in close methods: "NOT_FOUND - no queue 'q'"."""
        return f"{REPLY_TEXT.get(self.code, 'ERROR')} - {self.text}"

    def __str__(self) -> str:
        return f"{self.code} {self.reply_text}"


class AMQPConnectionError(AMQPError):
    """Closes the whole connection (connection.close)."""


class AMQPChannelError(AMQPError):
    """Closes only the channel (channel.close)."""
