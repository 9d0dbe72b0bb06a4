"""Fleets of fleetd nodes, as a library (fleetctl in fleetd/ctl and the TUI in tui/ sit on it;
it imports neither):

    nodes_file.py      the nodes file: NodeSpec, parse_nodes, load_nodes
    ssh.py             paramiko connect and direct-tcpip channels, errors translated once
    control_client.py  http.client over that channel (or loopback TCP) to the control API
    control_docs.py    NodeStatus, NodeStats, P2pState: the control API's answers, typed
    node.py            Node (one host: SSH, control API) and Fleet (all of them, in parallel)
    remote.py, agent.py, deploy.py   run things on nodes; deploy, health check, roll back
    ab.py              the A/B runner: hub vs direct over the fleet (fleetd.pipeline)
    model_ab.py        the same with a real model and the patched llama.cpp tools, per shape
    server_load.py     llama-server on loopback under closed-loop clients (model_ab's server shape)
    chart.py           a bar chart as a PNG file (numpy and zlib)
    lab.py, netns.py   an emulated network: fleetd in network namespaces, tc-rated links
    local.py           LocalFleet: fleetd processes on loopback (demo, benchmarks, tests)
    plan.py, plan_probe.py   fleetctl plan: placement from the GGUF and the measured nodes
    stage.py, stage_store.py fleetctl stage: the plan's hashed tensors into the nodes' caches
    render.py          pure renderers: rich tables and text for all of the above
"""
