"""AMQP 0-9-1 termination: the connection and channel state machines and their helpers."""
