"""The Kafka stream worker (`loopwatch worker`): a faust service running the same pure
pipeline as `loopwatch replay`. streams/worker/service.py wires the parts."""
