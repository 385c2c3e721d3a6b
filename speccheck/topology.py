"""The GPUs of this host as the driver sees them: how many a process can use, and how they are
linked (``nvidia-smi topo -m``). Tensor-parallel runs reduce across these links, so the
identity of a run records them and ``speccheck doctor`` checks them. Parsing is over text, so
recorded ``nvidia-smi`` outputs test it on a machine without a GPU.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Sequence

#: nvidia-smi's legend for ``topo -m``, best link first (``NV#``: a bonded set of # NVLinks)
LINK_MEANING = {
    "NV": "NVLink",
    "PIX": "PCIe through at most one PCIe bridge",
    "PXB": "PCIe through several PCIe bridges, not the host bridge",
    "PHB": "PCIe through a PCIe host bridge (the CPU)",
    "NODE": "PCIe and the interconnect between host bridges within a NUMA node",
    "SYS": "PCIe and the SMP interconnect between NUMA nodes (QPI/UPI)",
}
_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NV = re.compile(r"^NV(\d+)$")


@dataclass
class Topology:
    """The GPU-to-GPU part of ``nvidia-smi topo -m``: ``links[(i, j)]`` is the legend code
    between GPU i and GPU j (nvidia-smi's indices)."""

    gpus: int
    links: dict[tuple[int, int], str] = field(default_factory=dict)

    def link(self, i: int, j: int) -> str | None:
        return self.links.get((i, j)) or self.links.get((j, i))


def parse_topo(text: str) -> Topology:
    """``nvidia-smi topo -m`` -> the GPU matrix. Columns are tab-separated under a header row
    that starts with a tab (``\\tGPU0\\tGPU1...\\tCPU Affinity...``); NIC rows and columns,
    affinities and the legend are skipped; terminal escape codes are stripped. ValueError when
    the text has no GPU matrix."""
    header: list[str] | None = None
    rows: dict[int, list[str]] = {}
    for raw in _ANSI.sub("", text).splitlines():
        cells = [c.strip() for c in raw.split("\t")]
        if header is None:
            if len(cells) > 1 and cells[0] == "" and cells[1].startswith("GPU"):
                header = cells
            continue
        m = re.fullmatch(r"GPU(\d+)", cells[0])
        if m:
            rows[int(m.group(1))] = cells
        elif cells[0] and not cells[0].startswith(("NIC", "mlx")):
            break  # the legend
    if header is None or not rows:
        raise ValueError("no GPU matrix in this `nvidia-smi topo -m` output")
    cols = {i: int(m.group(1)) for i, name in enumerate(header)
            if (m := re.fullmatch(r"GPU(\d+)", name))}
    topo = Topology(gpus=len(rows))
    for i, cells in rows.items():
        for col, j in cols.items():
            if j != i and col < len(cells) and cells[col] and cells[col] != "X":
                topo.links[(i, j)] = cells[col]
    return topo


def link_rank(link: str) -> tuple[int, int]:
    """Sort key, best link first: NVLink (more links first), then PIX, PXB, PHB, NODE, SYS,
    then anything nvidia-smi may add later."""
    m = _NV.match(link)
    if m:
        return (0, -int(m.group(1)))
    return (_ORDER.index(link), 0) if link in _ORDER else (len(_ORDER), 0)


def is_nvlink(link: str | None) -> bool:
    return bool(link and _NV.match(link))


def describe_link(link: str | None) -> str:
    if link is None:
        return "no link (one GPU)"
    m = _NV.match(link)
    if m:
        return f"{link} (NVLink, {m.group(1)} bonded links)"
    return f"{link} ({LINK_MEANING.get(link, 'unknown to speccheck')})"


def weakest_link(topo: Topology, gpus: Sequence[int]) -> str | None:
    """The slowest link between any two of ``gpus`` (what a ring or tree all-reduce over all of
    them waits on); None for fewer than two GPUs or when a pair is missing from the matrix."""
    pairs = [(a, b) for n, a in enumerate(gpus) for b in gpus[n + 1:]]
    links = [topo.link(a, b) for a, b in pairs]
    if not pairs or any(x is None for x in links):
        return None
    return max(links, key=link_rank)


def visible_gpus(cuda_visible_devices: str | None, physical: int | None) -> tuple[int | None, list[int] | None]:
    """``(count, indices)`` of the GPUs a CUDA process may use: all ``physical`` ones when
    CUDA_VISIBLE_DEVICES is unset, else its entries up to the first invalid one (as CUDA reads
    it: ``-1`` or an out-of-range index ends the list). UUID/MIG entries count, but their
    nvidia-smi indices are unknown (indices None). ``count`` None: nothing to tell from."""
    if cuda_visible_devices is None:
        return (physical, list(range(physical)) if physical is not None else None)
    indices: list[int] = []
    uuids = 0
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            uuids += 1
            continue
        if not entry.isdigit() or (physical is not None and int(entry) >= physical):
            break
        indices.append(int(entry))
    return (len(indices) + uuids, indices if not uuids else None)


def nvidia_smi(*args: str, timeout: float = 20) -> str | None:
    """stdout of ``nvidia-smi ARGS``, None where there is none (no driver, no GPU, error)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def physical_gpu_count() -> int | None:
    """GPUs the driver lists (``nvidia-smi -L``), whatever CUDA_VISIBLE_DEVICES says."""
    out = nvidia_smi("-L")
    return None if out is None else sum(1 for line in out.splitlines() if line.startswith("GPU "))


def host_topology() -> Topology | None:
    out = nvidia_smi("topo", "-m")
    try:
        return parse_topo(out) if out else None
    except ValueError:
        return None
