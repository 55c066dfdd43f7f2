"""MQTT 3.1.1: the sans-IO packet codec (codec.py) and topic names and filters (topics.py)."""
