"""What runs on every GPU node: the recorder (:mod:`ingero.agent.trace`) and the agent API server
(:mod:`ingero.agent.api`). Nothing here imports the layers above it (tools, metrics, fleet, cli): the
node's server is composed at the edge (``ingero serve`` / ``ingero trace --listen``)."""
