"""MQTT 3.1.1 termination: one state machine per connection (connection.py) over the codec in broker/mqtt/."""
