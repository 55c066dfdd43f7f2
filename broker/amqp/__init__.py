"""Sans-IO AMQP 0-9-1 codec: FrameParser (bytes -> events) and encoders (see docs/codec.md)."""
