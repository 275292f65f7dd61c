"""A Ray cluster of two (or ``argv[1]``) one-CPU nodes on loopback for tests/distributed/test_two_nodes.py, in its own process.

Prints ``ADDRESS host:port`` once both nodes are up, then obeys one command per stdin line:
``kill`` (the second node's raylet and workers die at once, as in a machine loss), ``add`` (a new
second node), ``quit``. Each command answers one line."""

import sys

from ray.cluster_utils import Cluster


def main() -> None:
    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=100 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    second = cluster.add_node(**node)
    for _ in range(nodes - 2):
        cluster.add_node(**node)
    print(f"ADDRESS {cluster.address}", flush=True)
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "kill":
                cluster.remove_node(second, allow_graceful=False)
                print("KILLED", flush=True)
            elif cmd == "add":
                second = cluster.add_node(**node)
                print("ADDED", flush=True)
            elif cmd == "quit":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
