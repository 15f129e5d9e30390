"""Compile the Pallas Triton kernels for an H200 (sm_90) on a machine without a GPU.

The decode kernels are known to *lower* on a CPU-only machine: `jax.export(...,
platforms=["cuda"])` runs the Pallas Triton lowering and carries the kernel's Triton IR in a
`__gpu$xla.gpu.triton` custom call. A kernel can lower and still fail to build on the GPU (shared
memory over the per-block limit) or build slowly (register spills). This module takes that IR
through PyPI `triton`'s compiler stages (ttir -> ttgir -> llir -> ptx) for
`GPUTarget("cuda", 90, 32)` and assembles the PTX with the `ptxas -v` bundled in the wheel; no
CUDA driver is needed. What comes back (`Resources`) is registers per thread, spill bytes,
shared memory per block (Triton's allocation) and the occupancy those allow on an H200.

Caveat: PyPI triton is not the Triton XLA pins, so the numbers are a screen for limits and
unsupported ops, not a copy of what XLA builds. Pitfall: jaxlib > 0.10.2 no longer emits the
Triton custom call when exporting on a CPU (it asks the CUDA plugin for its handler):
`triton_calls` then raises `TritonIRUnavailable` saying so, and tests skip on it only there.

`triton` is an optional dependency (the `test` extra); it is imported only when compiling.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import jax
import jaxlib

TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class GpuLimits:
  """Per-SM and per-block limits of a GPU (H200 = sm_90, CUDA programming guide table)."""
  name: str = "H200 (sm_90)"
  capability: int = 90
  num_sms: int = 132
  shared_per_block: int = 227 * 1024  # opt-in maximum of dynamic shared memory per block
  shared_per_sm: int = 228 * 1024
  shared_reserved_per_block: int = 1024  # the runtime keeps 1 KiB of each block's share
  registers_per_sm: int = 65536
  register_granule: int = 256  # registers are allocated per warp in units of 256
  max_warps_per_sm: int = 64
  max_blocks_per_sm: int = 32


H200 = GpuLimits()


class TritonIRUnavailable(RuntimeError):
  """This jaxlib does not put the Triton IR into a CUDA export made on a CPU-only machine."""


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """One Pallas Triton kernel of an exported program: its IR text and launch parameters."""
  name: str
  ir: str
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one compiled kernel needs per block, and what that leaves of an SM."""
  name: str
  registers: int  # per thread
  spill_store_bytes: int
  spill_load_bytes: int
  stack_bytes: int
  shared_bytes: int  # Triton's shared-memory allocation per block
  num_warps: int
  num_stages: int
  blocks_per_sm: int  # resident blocks per SM allowed by registers, shared memory and warps
  occupancy: float  # resident warps / max warps per SM

  @property
  def spill_bytes(self) -> int:
    return self.spill_store_bytes + self.spill_load_bytes

  def problems(self, limits: GpuLimits = H200) -> list[str]:
    """Why this kernel is not fit for `limits` (empty when it is)."""
    out = []
    if self.spill_bytes:
      out.append(f"{self.name}: spills {self.spill_store_bytes} bytes (stores) / "
                 f"{self.spill_load_bytes} bytes (loads) at {self.registers} registers")
    if self.shared_bytes > limits.shared_per_block:
      out.append(f"{self.name}: {self.shared_bytes} bytes of shared memory per block, over "
                 f"the {limits.shared_per_block} bytes {limits.name} allows")
    return out


def jaxlib_emits_triton_on_cpu() -> bool:
  """True on jaxlib <= 0.10.2, the last that writes the Triton IR into a CPU-side export."""
  parts = tuple(int(p) for p in re.findall(r"\d+", jaxlib.__version__)[:3])
  return parts <= (0, 10, 2)


def _unavailable(detail: str) -> TritonIRUnavailable:
  return TritonIRUnavailable(
      f"jaxlib {jaxlib.__version__} did not emit the {TRITON_CALL} custom call when exporting "
      f"for CUDA on this machine ({detail}): jaxlib > 0.10.2 asks the CUDA plugin for the "
      "Triton handler, which a CPU-only install lacks. Run on jaxlib 0.10.2 or with jax[cuda].")


def triton_calls(fn, *args) -> list[TritonCall]:
  """Exports `fn(*args)` for CUDA and returns every Pallas Triton kernel in it.

  Raises TritonIRUnavailable on a jaxlib that no longer emits the IR on a CPU (the error says
  so); any other failure propagates.
  """
  from jax import export
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  try:
    exported = export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  except Exception as e:  # noqa: BLE001  re-raised unless it is the known jaxlib change
    if jaxlib_emits_triton_on_cpu():
      raise
    raise _unavailable(f"{type(e).__name__}: {e}") from e
  ctx = mlir.make_ir_context()
  tt_dialect.register_dialect(ctx)
  calls = []
  with ctx:
    module = ir.Module.parse(exported.mlir_module())

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            child = child.operation
            if (child.name == "stablehlo.custom_call" and
                ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL):
              cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
              num = lambda key: ir.IntegerAttr(cfg[key]).value
              # The IR travels as bytecode; triton's parser reads the text form.
              text = str(ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes))
              calls.append(TritonCall(
                  name=ir.StringAttr(cfg["name"]).value, ir=text, num_warps=num("num_warps"),
                  num_stages=num("num_stages"),
                  grid=(num("grid_x"), num("grid_y"), num("grid_z"))))
            walk(child)

    walk(module.operation)
  if not calls and not jaxlib_emits_triton_on_cpu():
    raise _unavailable("no Triton custom call in the exported module")
  return calls


_PTXAS_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}


def parse_ptxas(log: str) -> dict[str, int]:
  """Registers, stack and spill bytes from `ptxas -v` output (one kernel)."""
  out = {}
  for key, pattern in _PTXAS_PATTERNS.items():
    found = re.search(pattern, log)
    if found is None:
      raise ValueError(f"ptxas -v output has no {key!r} line ({pattern!r}):\n{log}")
    out[key] = int(found.group(1))
  return out


def blocks_per_sm(registers: int, shared_bytes: int, num_warps: int,
                  limits: GpuLimits = H200) -> int:
  """Resident blocks per SM allowed by registers, shared memory, warps and the block cap."""
  per_warp = -(-registers * 32 // limits.register_granule) * limits.register_granule
  by_regs = (limits.registers_per_sm // max(per_warp, 1)) // num_warps
  by_shared = limits.shared_per_sm // (shared_bytes + limits.shared_reserved_per_block)
  by_warps = limits.max_warps_per_sm // num_warps
  return max(0, min(by_regs, by_shared, by_warps, limits.max_blocks_per_sm))


def compile_call(call: TritonCall, limits: GpuLimits = H200,
                 stages_out: dict | None = None) -> Resources:
  """Compiles one kernel's Triton IR for `limits.capability` with PyPI triton and ptxas -v.
  `stages_out`: a dict that receives the text of every stage ("ttir", "ttgir", "llir",
  "ptx"; the PTX is what `ptx_memory_ops` reads)."""
  from triton._C.libtriton import ir as tir
  from triton.backends.compiler import GPUTarget, Language
  from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
  from triton.compiler.compiler import make_backend

  backend = make_backend(GPUTarget("cuda", limits.capability, 32))
  # FP fusion on: triton 3.9's default (and XLA's), asked for explicitly (no warning).
  options = backend.parse_options({"num_warps": call.num_warps, "num_stages": call.num_stages,
                                   "enable_fp_fusion": True})
  stages: dict = {}
  backend.add_stages(stages, options, Language.TRITON)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, f"{call.name}.ttir")
    with open(path, "w") as f:
      f.write(call.ir)
    ctx = tir.context()
    tir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = tir.parse_mlir_module(path, ctx)
    module.context = ctx
    metadata: dict = {}
    for stage in ("ttir", "ttgir", "llir", "ptx"):
      module = stages[stage](module, metadata)
      if stages_out is not None:
        stages_out[stage] = module if isinstance(module, str) else str(module)
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(module)
    arch = sm_arch_from_capability(limits.capability)
    proc = subprocess.run([get_ptxas(limits.capability).path, "-v", f"--gpu-name={arch}", ptx,
                           "-o", os.path.join(tmp, "kernel.cubin")],
                          capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"ptxas failed on {call.name} (exit {proc.returncode}):\n{proc.stderr}")
  found = parse_ptxas(proc.stderr)
  shared = int(metadata.get("shared") or 0)
  blocks = blocks_per_sm(found["registers"], shared, call.num_warps, limits)
  return Resources(name=call.name, shared_bytes=shared, num_warps=call.num_warps,
                   num_stages=call.num_stages, blocks_per_sm=blocks,
                   occupancy=blocks * call.num_warps / limits.max_warps_per_sm, **found)


def compile_fn(fn, *args, limits: GpuLimits = H200) -> list[Resources]:
  """Resources of every Pallas Triton kernel `fn(*args)` launches, compiled for `limits`."""
  return [compile_call(c, limits) for c in triton_calls(fn, *args)]


_PTX_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
MEMORY_OPS = ("ld.global", "st.global", "cp.async.ca", "cp.async.cg", "ld.shared", "st.shared",
              "ldmatrix", "stmatrix", "mma", "bar.sync")


def _op_key(line: str) -> str | None:
  """The memory / tensor-core op of one PTX line with its width: `ld.global.v4.b32` ->
  "ld.global 128b", `cp.async.cg.shared.global [..], [..], 0x10` -> "cp.async.cg 16B"."""
  found = _PTX_OP.match(line)
  if not found:
    return None
  op = found.group(1)
  base = next((m for m in MEMORY_OPS if op.startswith(m)), None)
  if base is None:
    return None
  if base in ("ld.global", "st.global", "ld.shared", "st.shared"):
    vec = re.search(r"\.v(\d)", op)
    bits = re.search(r"\.[bfus](\d+)$", op)
    width = (int(vec.group(1)) if vec else 1) * (int(bits.group(1)) if bits else 0)
    return f"{base} {width}b"
  if base.startswith("cp.async"):
    size = re.search(r",\s*(0x[0-9a-fA-F]+|\d+)\s*(?:,|;)", line)
    return f"{base} {int(size.group(1), 0)}B" if size else base
  return base


def ptx_memory_ops(ptx: str) -> dict:
  """Counts of the global / shared memory and tensor-core instructions of a kernel's PTX, by
  op and width ("ld.global 128b": ld.global.v4.b32; "cp.async.cg 16B"; "mma"; ...), for the
  whole kernel ("kernel") and for its largest loop ("loop": the lines from a label to the
  last branch back to it, i.e. the K/V block loop of the decode kernels; {} without a loop).
  Static counts: what one trip of the loop issues per thread, not what executes."""
  lines = ptx.splitlines()
  labels = {}
  loops = []
  for i, line in enumerate(lines):
    lab = _LABEL.match(line.strip())
    if lab:
      labels[lab.group(1)] = i
    br = _BRANCH.search(line)
    if br and br.group(1) in labels:
      loops.append((labels[br.group(1)], i))

  def count(part):
    out: dict[str, int] = {}
    for line in part:
      key = _op_key(line)
      if key:
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))

  loop = max(loops, key=lambda se: se[1] - se[0], default=None)
  return {"kernel": count(lines),
          "loop": count(lines[loop[0]:loop[1] + 1]) if loop else {},
          "loop_lines": (loop[1] - loop[0] + 1) if loop else 0}
