"""The `flashkern` command: `flashkern info` (what was built, what runs where) and `flashkern check`
(every op family against the float64 references). Bad arguments are a one-line error and exit code 2,
never a traceback."""

import argparse
import json
import sys
import time

BACKEND_HELP = ("run under this backend, as FLASHKERN_BACKEND does: auto, reference, cuda, hip, emulate (the CUDA "
                "kernels' own code on CPU tensors, slow) or emulate-wave64")


def _print_info(data):
    print(f"flashkern {data['flashkern']}  torch {data['torch']} (cuda {data['torch_cuda']}, hip {data['torch_hip']})")
    archs = ", ".join(f"{a} (warp {w})" for a, w in data["warp_sizes"].items()) or "-"
    print(f"built: {data['built_backend']} kernels; architectures: {archs}")
    print("modules: " + ", ".join(f"{name} ({'built' if built else 'not built'})"
                                  for name, built in data["modules"].items()))
    print(f"FLASHKERN_BACKEND: {data['forced_backend']}")
    print("devices:")
    for d in data["devices"]:
        extra = "".join(f", {k} {d[k]}" for k in ("arch", "multiprocessors", "warp_size", "kernels", "source",
                                                  "memory_gib") if d.get(k) is not None)
        print(f"  {d['device']:8} {d['name']}{extra} -> {d['backend']}")
    print("ops:")
    width = max(map(len, data["ops"]), default=0)
    for op, where in data["ops"].items():
        print(f"  {op:{width}}  " + ", ".join(f"{dev}: {b}" for dev, b in where.items()))


def _print_check(rows, seconds):
    header = f"{'family':14} {'op':44} {'device':7} {'backend':14} {'dtype':8} {'shape':16} {'error':>9}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['family']:14} {r['op']:44} {r['device']:7} {r['backend']:14} {r['dtype']:8} {str(r['shape']):16} "
              f"{r['max_abs_err']:9.2e}  {'pass' if r['passed'] else 'FAIL'}")
        if "error" in r:
            print(f"    {r['error']}")
    failed = [r for r in rows if not r["passed"]]
    families = sorted({r["family"] for r in rows})
    print(f"\n{len(families)} op families on {len(sorted({r['device'] for r in rows}))} device(s) in {seconds:.1f} s")
    if failed:
        print("failed: " + ", ".join(sorted({f"{r['op']} ({r['device']}, {r['dtype']})" for r in failed})))
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")


def _parser():
    from .check import FAMILIES

    parser = argparse.ArgumentParser(prog="flashkern", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="{info,check}")
    sub.required = True
    info = sub.add_parser("info", help="what was built, the visible devices and which backend runs each op",
                          description="What this flashkern build has (backend, architectures, warp sizes, the "
                                      "emulate modules), the visible devices and which backend runs each op.")
    check = sub.add_parser("check", help="every op family on every available device against the float64 references",
                           description="Every op family (" + ", ".join(FAMILIES) + ") on every available device "
                                       "against the float64 references; exit code 1 if any case fails.")
    for p in (info, check):
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.add_argument("--backend", help=BACKEND_HELP)
    check.add_argument("--family", action="append", choices=list(FAMILIES), metavar="FAMILY",
                       help="only this family (repeatable): " + ", ".join(FAMILIES))
    check.add_argument("--device", action="append", help="only this device (repeatable), e.g. cpu or cuda:0")
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)

    import torch

    import flashkern
    from flashkern import _backend

    if _backend.STARTUP_ERROR is not None and args.backend is None:  # FLASHKERN_BACKEND wrong
        parser.error(str(_backend.STARTUP_ERROR))
    if args.backend is not None:
        try:
            flashkern.set_backend(args.backend)
        except (ValueError, RuntimeError) as e:
            parser.error(str(e))  # exit code 2, one line
    if args.command == "info":
        data = flashkern.info()
        print(json.dumps(data, indent=2)) if args.json else _print_info(data)
        return 0
    for device in args.device or []:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, ValueError) as e:
            parser.error(f"--device {device}: {str(e).splitlines()[0]}")
    start = time.perf_counter()
    rows = flashkern.check(devices=args.device, families=args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_check(rows, time.perf_counter() - start)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
