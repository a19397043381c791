#!/usr/bin/env bash
# The wheels part 9 (benchmarks/gpu_parts_peers.py) needs on the GPU machine, downloaded HERE (with
# network) into .whl/ at the repository root (ignored by git; carried to the GPU machine with the
# working tree, which allows 40 MiB of it). The GPU image (Python 3.12, torch 2.11.0+cu130) has
# ninja, psutil, py-cpuinfo, numpy, packaging, msgpack, einops, tqdm, nvidia-ml-py, typing-extensions
# already (/work/.library/device/KINDS.md, "Python packages already there"); it lacks torchao,
# deepspeed, hjson and pydantic (with pydantic-core, annotated-types, typing-inspection), so those
# are fetched with --no-deps, each named here with its version.
#
# - torchao 0.17.0: its C++ extensions need torch >= 2.11 (its __init__ says so; the
#   CPUOffloadOptimizer used by part 9 is Python).
# - deepspeed 0.19.8: PyPI has only its sdist; built here into a wheel with DS_BUILD_OPS=0 (no op
#   compiled: its CPU Adam is JIT-built on the GPU machine with ninja; the wheel is Python plus the
#   op sources), against this machine's torch (what it records is checked only for prebuilt ops).
#
# Run from anywhere:  bash benchmarks/gpu_wheels.sh      (prints what it fetched and the total size)
# On the GPU machine part 9 installs them with
#   python3 -m pip install --no-deps --no-index --target <tmp> .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"
LIMIT=$((40 * 1024 * 1024))

PLAT=(--python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# binary wheels (pure Python ones are any-platform wheels and match too)
WHEELS=(
  torchao==0.17.0
  pydantic==2.11.10
  pydantic-core==2.33.2
  annotated-types==0.7.0
  typing-inspection==0.4.5
  hjson==3.1.0
)
DEEPSPEED=deepspeed==0.19.8

for spec in "${WHEELS[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DEST" "$spec"
done

# deepspeed: sdist -> wheel (pure Python, no ops built)
name=${DEEPSPEED%%==*}; ver=${DEEPSPEED##*==}
if ! ls "$DEST"/${name}-${ver}-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --no-binary=:all: -d "$tmp" "$DEEPSPEED"
  # --no-build-isolation: its setup.py imports torch (this machine's), only to read versions when
  # no op is prebuilt
  DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" "$tmp"/${name}-${ver}.tar.gz
fi

echo "wheels in $DEST:"
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
python3 -c "import sys; t = int(sys.argv[1]); print(f'total: {t} bytes ({t / 2**20:.1f} MiB), limit 40 MiB')" "$total"
if [ "$total" -gt "$LIMIT" ]; then
  echo "over the 40 MiB limit" >&2
  exit 1
fi
