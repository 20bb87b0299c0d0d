"""The `flashkern` command: `flashkern info`, `flashkern check`."""

import argparse
import json
import sys


def _print_info(data):
    print(f"flashkern {data['flashkern']}  torch {data['torch']} (cuda {data['torch_cuda']}, hip {data['torch_hip']})")
    archs = ", ".join(f"{a} (warp {w})" for a, w in data["warp_sizes"].items()) or "-"
    print(f"built: {data['built_backend']} kernels; architectures: {archs}")
    print(f"FLASHKERN_BACKEND: {data['forced_backend']}")
    print("devices:")
    for d in data["devices"]:
        extra = "".join(
            f", {k} {d[k]}" for k in ("arch", "multiprocessors", "warp_size", "kernels", "source", "memory_gib") if d.get(k) is not None
        )
        print(f"  {d['device']:8} {d['name']}{extra} -> {d['backend']}")
    print("ops:")
    width = max(map(len, data["ops"]), default=0)
    for op, where in data["ops"].items():
        print(f"  {op:{width}}  " + ", ".join(f"{dev}: {b}" for dev, b in where.items()))


def _print_check(rows):
    header = f"{'op':32} {'device':7} {'backend':14} {'dtype':8} {'shape':14} {'max abs err':>11}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:32} {r['device']:7} {r['backend']:14} {r['dtype']:8} {str(r['shape']):14} "
            f"{r['max_abs_err']:11.2e}  {'pass' if r['passed'] else 'FAIL'}"
        )
    failed = sum(not r["passed"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="flashkern", description=__doc__)
    parser.add_argument("command", choices=["info", "check"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--backend", help="force a backend first, as FLASHKERN_BACKEND does (e.g. emulate: "
                        "the CUDA kernels' own code on CPU tensors)")
    args = parser.parse_args(argv)

    import flashkern

    if args.backend:
        flashkern.set_backend(args.backend)

    if args.command == "info":
        data = flashkern.info()
        print(json.dumps(data, indent=2)) if args.json else _print_info(data)
        return 0
    rows = flashkern.check()
    print(json.dumps(rows, indent=2)) if args.json else _print_check(rows)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
