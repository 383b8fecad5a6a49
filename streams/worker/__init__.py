"""The Kafka stream worker (`loopwatch worker`): a faust service running the same run loop
as `loopwatch replay`. service.py wires the parts: agents/ (what the stream processors do),
state/ (the tables and their format), kafka/ (topics, delivery, broker state, input clock),
api/ (the on-call API); faust_internals.py is the one door to faust's private internals."""
