"""The MCP ``investigate`` prompt and the server's instructions: how an assistant should use the tools."""

from __future__ import annotations

from ingero.store.catalog import SOURCES

_SOURCE_IDS = ", ".join(f"{sid} {name}" for sid, name, _ in SOURCES)

INSTRUCTIONS = f"""\
ingero answers "why is my GPU job slow?" from eBPF traces: CUDA runtime/driver and NCCL calls plus host
events (scheduler, block I/O, page allocation, process lifecycle, TCP), one SQLite database per node.
Tools are read-only. Start with get_trace_stats, then get_causal_chains (causal chains = symptom -> host
cause -> fix), then get_stacks/processes/event_history/run_sql to confirm. query_fleet asks every live
agent at once, find_outlier_nodes names the node unlike its peers (node column first;
clock-skew warnings and unreachable nodes come first in its answer).
Times: events.timestamp and duration are nanoseconds; sources {_SOURCE_IDS};
join ops on (source, op) for names. 'since' is a duration such as 30s, 5m, 2h; on a
finished recording it counts back from the recording's last event.
"""


def investigate_prompt(symptom: str = "", since: str = "5m", fleet: bool = False) -> str:
    """Walks an assistant from overview to a root cause it can defend with numbers."""
    what = symptom.strip() or "the GPU workload is slower than expected"
    fleet_steps = (
        f"""
2b. This is a fleet: call fleet_status() to see which nodes answer and their clock skew,
    then query_fleet(action="chains", since="{since}") for every node's chains and the straggler
    verdict, and find_outlier_nodes(since="{since}") for the figures behind it. Name the straggler node (if any) and keep its clock-skew warning in mind when comparing
    timestamps across nodes."""
        if fleet
        else ""
    )
    return f"""\
Investigate this GPU performance problem with the ingero tools: {what}

Work step by step and show the numbers behind each conclusion.

1. get_trace_stats(since="{since}"): which nodes, how many events, the time span, the slowest ops by total time
   (p50/p99 and tail ratio p99/p50) and how many causal chains of each severity exist. If it says the
   recording is not live, 'since' counted back from its last event.
2. get_causal_chains(since="{since}"): read the HIGH chains first. Each chain links a GPU symptom (e.g. "cudaStreamSync
   p99 63x p50") to host evidence (sched_switch off-CPU time, block I/O, page allocation, TCP
   retransmits) and gives a fix. Note the node and process of each.{fleet_steps}
3. For the op named by the strongest chain: get_stacks(op=..., since="{since}") to see which code path
   calls it most and how slow each path is.
4. processes(since="{since}"): is the GPU process itself busy, or is another process (a data loader,
   a checkpoint writer, a noisy neighbour) taking CPU or disk?
5. Confirm with run_sql() (or event_history() for the latest events): e.g. the off-CPU time of the GPU process per second, or block I/O latency over
   time: SELECT node, source, count(*) AS cnt, avg(duration)/1000 AS avg_us FROM events GROUP BY node, source
6. Conclude: the root cause in one sentence, the evidence (numbers, node, pid, op), the fix to try
   first, and what would prove it worked (which number should drop, and to about what).
If a tool returns an error, read it: it says what to change (a since value, an op name, a SQL fix).
"""
