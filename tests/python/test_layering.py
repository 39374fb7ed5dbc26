"""The layer rules of docs/ARCHITECTURE.md ("Who includes whom") on src/: every #include of a
kiln header points at the file's own layer or a lower one, nothing outside src/ops/ reaches a
backend's folder or its kiln_cuda_* functions, and nobody compares a backend's name. A
property of the source tree: no build needed."""
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# rank: a layer may include its own rank and lower ones; engines (rank 5) only their own folder.
# dist (the communicator) sits below the engines that will call it but includes base only
# (ONLY_BASE): it moves bytes and adds floats, and knows nothing of models or ops.
RANK = {"base": 0, "formats": 1, "tokenizer": 2, "ops": 3, "models": 4, "dist": 4.5, "generate": 5,
        "train": 5, "serve": 6}
ONLY_BASE = {"dist"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def sources():
    return sorted(p for p in SRC.rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))


def layer_of(path):
    """(layer, backend folder or None) of a path under src/."""
    parts = path.relative_to(SRC).parts
    backend = parts[1] if parts[0] == "ops" and len(parts) > 2 else None
    return parts[0], backend


def test_every_source_is_in_a_layer():
    assert sources(), SRC
    for p in sources():
        assert layer_of(p)[0] in RANK, p


def test_includes_flow_down():
    bad = []
    for p in sources():
        layer, backend = layer_of(p)
        for inc in INCLUDE.findall(p.read_text(errors="replace")):
            target = (p.parent / inc).resolve()
            if not target.is_relative_to(SRC) or not target.exists():
                continue  # kiln.h, system and third-party headers
            tl, tb = layer_of(target)
            ok = RANK[tl] < RANK[layer] or tl == layer
            if layer in ONLY_BASE and tl not in ("base", layer):
                ok = False
            if tl == "ops" and tb and tb != backend:
                # a backend's folder: its own files, and the generic entries' fallback to the
                # CPU reference (adamw_op.c without a backend); never the other backend
                ok = layer == "ops" and (backend is None and tb == "cpu")
            if target.name == "fused_ce_impl.h" and layer != "ops":
                ok = False  # shared by the op's bodies only
            if ok:
                continue
            bad.append(f"{p.relative_to(SRC)} includes {inc}")
    assert not bad, "\n".join(bad)


def test_backends_stay_behind_the_table():
    bad = []
    name_cmp = re.compile(r'name\s*,\s*"(cpu|cuda)"|"(cpu|cuda)"\s*,[^)]*name')
    # the backends' own entry points (ops/cpu/*.h, ops/cuda/*.h); ops.h's constructors
    # (kiln_backend_cpu_create, kiln_backend_cuda_create) are the table's and allowed
    backend_name = re.compile(r"\bkiln_cuda_\w|\bkiln_backend_cpu_(pool|path)\b|"
                              r"\bkiln_cpu_(kernels|fused_ce|adamw)")
    for p in sources():
        if layer_of(p)[0] == "ops":
            continue
        text = p.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if backend_name.search(line) or name_cmp.search(line):
                bad.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
