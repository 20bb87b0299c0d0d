"""Reading compiled kernels without a GPU: ptxas's resource report, the SASS of a cubin (cuobjdump), and
the figures that decide a kernel's speed, counted from its instructions.

Everything here is static: instructions as laid out by the compiler, not as issued. A loop is the code
between a backward branch and its target; straight-line figures (loads in flight) follow address order
and ignore where forward branches go, which is exact for branch-free bodies and an estimate elsewhere.
"""

import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------- tools


@functools.cache
def disassembler():
    """The directory holding cuobjdump and nvdisasm (cuobjdump calls nvdisasm), or None: on PATH, or the
    nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels of this Python (scripts/setup.sh installs them)."""
    candidates = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for entry in sys.path:  # the wheels put them in site-packages/nvidia/cu13/bin
        candidates += sorted(Path(entry).glob("nvidia/cu*/bin"))
    for directory in candidates:
        if (directory / "cuobjdump").is_file() and (directory / "nvdisasm").is_file():
            return directory
    return None


MISSING_DISASSEMBLER = ("no cuobjdump and nvdisasm: install the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels "
                        "(scripts/setup.sh does) or put a CUDA toolkit's bin on PATH")


def cuobjdump(option, path):
    """cuobjdump `option` (-sass, -ptx) of a cubin, or of an object or library holding a fat binary, as text."""
    tools = disassembler()
    if tools is None:
        raise RuntimeError(MISSING_DISASSEMBLER)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(tools / "cuobjdump"), option, str(path)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump {option} {path}: {done.stderr.strip()}")
    return done.stdout


def dump_sass(cubin):
    return cuobjdump("-sass", cubin)


def by_arch(text):
    """{'sm_90': text} of cuobjdump output over a fat binary: its sections ("Fatbin elf code:" or "Fatbin ptx
    code:", then "arch = sm_90"), one architecture each."""
    sections = {}
    for part in re.split(r"^Fatbin (?:elf|ptx) code:$", text, flags=re.M)[1:]:
        m = re.search(r"^arch = (sm_\w+)$", part, flags=re.M)
        if m:
            sections[m.group(1)] = sections.get(m.group(1), "") + part
    return sections


def demangle(names):
    names = sorted(set(names))
    if not names:
        return {}
    out = subprocess.run([shutil.which("c++filt") or "c++filt"], input="\n".join(names), capture_output=True,
                         text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


# ---------------------------------------------------------------- ptxas -v


@dataclass
class Resources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0  # static shared memory, bytes
    barriers: int = 0


def ptxas_resources(log):
    """{(mangled kernel, 'sm_90'): Resources} from ptxas -v output (nvcc -Xptxas -v)."""
    reports, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            current = reports.setdefault(m.groups(), Resources())
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
            b = re.search(r"used (\d+) barriers", line)
            s = re.search(r"(\d+) bytes smem", line)
            current.barriers = int(b.group(1)) if b else 0
            current.shared = int(s.group(1)) if s else 0
    return reports


# ---------------------------------------------------------------- SASS


@dataclass
class Instruction:
    address: int
    predicate: str  # '' or e.g. '@!P0'
    opcode: str  # with its modifiers: 'LDG.E.128.CONSTANT'
    operands: list = field(default_factory=list)

    @property
    def base(self):
        return self.opcode.split(".")[0]


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P(?:T|\d))?\s*([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def parse_sass(text):
    """{mangled function: [Instruction]} from cuobjdump -sass output."""
    functions, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m and current is not None:
            address, predicate, opcode, operands = m.groups()
            parts = [o.strip() for o in operands.split(",")] if operands.strip() else []
            current.append(Instruction(int(address, 16), predicate or "", opcode, parts))
    return functions


def _width_bits(opcode):
    for bits in (128, 64):
        if f".{bits}" in opcode:
            return bits
    if any(f".{t}" in opcode for t in ("U16", "S16")):
        return 16
    if any(f".{t}" in opcode for t in ("U8", "S8")):
        return 8
    return 32


def _registers(operand, count=1):
    """The general registers an operand names (a .64 address names a pair)."""
    regs = set()
    for m in re.finditer(r"\bR(\d+)(\.64)?", operand):
        n = 2 if m.group(2) else count
        regs.update(range(int(m.group(1)), int(m.group(1)) + n))
    return regs


_NO_DESTINATION = ("ST", "STG", "STS", "STL", "RED", "BAR", "BRA", "EXIT", "RET", "BSSY", "BSYNC", "WARPSYNC",
                   "LDGSTS", "DEPBAR", "MEMBAR", "FENCE", "CALL", "NOP", "YIELD", "ERRBAR", "CCTL", "UTMALDG",
                   "UTMASTG", "UBLKCP", "SYNCS", "ARRIVES")


def sources_and_destination(ins):
    """(registers read, registers written) of an instruction, from its operand text."""
    wide = _width_bits(ins.opcode) // 32 if ins.base in ("STG", "STS", "ST", "STL", "RED") else 1
    if ins.base in _NO_DESTINATION or not ins.operands:
        reads = set()
        for operand in ins.operands:
            reads |= _registers(operand, wide if not operand.startswith(("[", "desc")) else 1)
        return reads, set()
    written = _registers(ins.operands[0], max(1, _width_bits(ins.opcode) // 32) if ins.base in ("LDG", "LDS", "LD", "LDL", "LDSM") else 1)
    reads = set()
    for operand in ins.operands[1:]:
        reads |= _registers(operand)
    return reads, written


def kind(ins):
    """The class an instruction counts under in the report's mix."""
    b = ins.base
    if b in ("HMMA", "HGMMA", "IMMA", "LDSM", "LDGSTS", "MUFU", "SHFL", "BAR", "BSSY", "BRA", "LDL", "STL", "LDS", "STS"):
        return b
    if b in ("UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF"):
        return "TMA"
    if b in ("LDG", "STG"):
        return f"{b}.{_width_bits(ins.opcode)}"
    return "other"


def mix(instructions):
    counts = {}
    for ins in instructions:
        counts[kind(ins)] = counts.get(kind(ins), 0) + 1
    counts["total"] = len(instructions)
    return counts


def loops(instructions):
    """[(first, last)] index ranges of the loops: a backward branch and the code back to its target."""
    index = {ins.address: i for i, ins in enumerate(instructions)}
    found = []
    for i, ins in enumerate(instructions):
        if ins.base == "BRA":
            m = re.search(r"0x([0-9a-f]+)", " ".join(ins.operands))
            if m and int(m.group(1), 16) <= ins.address and int(m.group(1), 16) in index:
                found.append((index[int(m.group(1), 16)], i))
    return found


def steady_loop(instructions, by="HMMA"):
    """The loop that holds the most instructions of kind `by` (the smallest such), or None."""
    best = None
    for first, last in loops(instructions):
        body = instructions[first:last + 1]
        n = sum(kind(ins) == by or ins.base == by for ins in body)
        if n and (best is None or n > best[0] or (n == best[0] and last - first < best[2] - best[1])):
            best = (n, first, last)
    return None if best is None else instructions[best[1]:best[2] + 1]


def _target(ins):
    m = re.search(r"0x([0-9a-f]+)", " ".join(ins.operands))
    return int(m.group(1), 16) if m else None


def main_path(body, needs, loop=True):
    """The shortest path through `body` (a loop: from its first instruction to its backward branch; else a
    function, to an EXIT) holding at least needs[k] instructions of each kind k ({"LDG.128": 8, "BAR": 1}): the code
    a thread runs at a shape that needs those (its loads, a reduction across warps) and none of the slow paths
    (tails, fix-ups) or other shapes' branches laid out beside them. Forward branches are followed both ways
    where predicated; a backward branch inside is not taken (an inner loop counts once); a path that leaves a
    loop early is not one. None if there is no such path."""
    kinds = sorted(needs)
    states = list(itertools.product(*(range(needs[k] + 1) for k in kinds)))  # what is still needed
    n, inf = len(body), float("inf")
    index = {ins.address: i for i, ins in enumerate(body)}

    def after(state, ins):  # the state once `ins` is on the path
        return tuple(max(0, c - (kind(ins) == k or ins.base == k)) for c, k in zip(state, kinds))

    cost = [dict.fromkeys(states, inf) for _ in range(n + 1)]  # cost[i][state]: fewest instructions from i to the end
    step = [{} for _ in range(n + 1)]
    cost[n][tuple(0 for _ in kinds)] = 0
    for i in range(n - 1, -1, -1):
        ins, successors = body[i], []
        if ins.base == "BRA":
            target = _target(ins)
            forward = target is not None and target > ins.address
            # conditional: a guard, a predicate operand (BRA P1, …) or a warp-convergence test (BRA.DIV, .CONV)
            conditional = bool(ins.predicate) or "." in ins.opcode or any(
                re.fullmatch(r"!?U?P(\d|T)", o.strip()) for o in ins.operands)
            if loop and i == n - 1:
                successors = [n]  # the back branch: the pass ends
            elif forward and target in index:
                successors = [index[target]]  # (a target past the body leaves it: no successor)
            if conditional or not forward:
                successors.append(i + 1)
        elif ins.base == "EXIT" and not ins.predicate:
            successors = [] if loop else [n]
        else:
            successors = [i + 1]
        for state in states:
            rest = after(state, ins)
            for s in successors:
                if 1 + cost[s][rest] < cost[i][state]:
                    cost[i][state], step[i][state] = 1 + cost[s][rest], s
    start = tuple(needs[k] for k in kinds)
    if cost[0][start] == inf:
        return None
    path, i, state = [], 0, start
    while i < n:
        path.append(body[i])
        i, state = step[i][state], after(state, body[i])
    return path


def wide_loads_in_flight(instructions):
    """The most 16-byte global loads issued and not yet used at any point, in address order: how many
    LDG.E.128 a thread keeps in flight before it waits on the first of them."""
    pending = {}  # index of the load -> its destination registers
    most = 0
    for i, ins in enumerate(instructions):
        reads, written = sources_and_destination(ins)
        used = [j for j, regs in pending.items() if regs & reads]
        for j in used:
            del pending[j]
        if ins.base == "LDG" and _width_bits(ins.opcode) == 128:
            pending[i] = written
            most = max(most, len(pending))
        else:  # a register overwritten before use: that load's value is dead here
            for j in [j for j, regs in pending.items() if regs & written]:
                del pending[j]
    return most


# ---------------------------------------------------------------- occupancy (sm_90: H100 and H200)


@dataclass(frozen=True)
class SM:
    name: str
    registers: int = 65536
    max_warps: int = 64
    max_blocks: int = 32
    shared: int = 228 * 1024  # per SM; each block also takes 1 KB the runtime reserves
    shared_reserved: int = 1024
    register_granule: int = 256  # registers are given to a warp in units of 256


HOPPER = SM("H100/H200 (sm_90)")


def occupancy(registers, block_threads, shared_bytes, sm=HOPPER):
    """(blocks, warps) resident on one SM for a kernel of `registers` a thread, `block_threads`, and
    `shared_bytes` of shared memory a block (static plus dynamic): the least of what registers, shared
    memory, warps and the block slots allow."""
    warps = -(-block_threads // 32)
    per_warp = -(-registers * 32 // sm.register_granule) * sm.register_granule
    by_registers = (sm.registers // per_warp) // warps if per_warp else sm.max_blocks
    by_shared = sm.shared // (shared_bytes + sm.shared_reserved)
    by_warps = sm.max_warps // warps
    blocks = max(0, min(by_registers, by_shared, by_warps, sm.max_blocks))
    return blocks, blocks * warps
