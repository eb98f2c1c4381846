#!/usr/bin/env bash
# Run once on your own machine, from the project root: fills the git-ignored folder .gpu/
# with what the lent GPU machine lacks, in pieces small enough to travel (64 MiB a call).
#   .gpu/bin/device.sh   the script the GPU machine runs (copied from here)
#   .gpu/deps/           small wheels + the DeepSpeed sdist (~30 MB, one call)
#   .gpu/c1 .. .gpu/c5   the vLLM 0.25.0 wheel in 60 MB parts (one call each)
# Then follow bench/gpu/README.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -d .git ] || [ -f .git ] || { echo "prepare.sh: run it from the project root" >&2; exit 1; }
gitdir=$(git rev-parse --git-dir)
grep -qx '/.gpu/' "$gitdir/info/exclude" 2>/dev/null || { mkdir -p "$gitdir/info"; echo '/.gpu/' >> "$gitdir/info/exclude"; }
mkdir -p .gpu/bin .gpu/deps .gpu/vllm
cp "$here/device.sh" .gpu/bin/device.sh
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_5_x86_64)
grep -v '^#' "$here/wheels.txt" | grep . | while read -r spec; do
  name=${spec%%==*}; norm=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
  ls .gpu/deps | tr '-' '_' | tr 'A-Z' 'a-z' | grep -q "^${norm}_${spec##*==}" && continue
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .gpu/deps "$spec"
done
[ -f .gpu/deps/deepspeed-0.19.8.tar.gz ] || python3 -m pip download -q --no-deps --no-binary=:all: -d .gpu/deps deepspeed==0.19.8
W=.gpu/vllm/vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl
[ -f "$W" ] || python3 -m pip download -q --no-deps "${PLAT[@]}" -d .gpu/vllm vllm==0.25.0
echo "c82e96b01af2142ef398ca92f1e9c5f4ffc119f2cc09fe68ea28865323532f0c  $W" | sha256sum -c --quiet
rm -rf .gpu/c[0-9]*; (cd .gpu/vllm && split -b 60M -d -a 1 --numeric-suffixes=1 "$(basename "$W")" part)
for p in .gpu/vllm/part*; do n=${p##*part}; mkdir -p ".gpu/c$n"; mv "$p" ".gpu/c$n/"; done
du -sh .gpu/deps .gpu/c* | tr '\n' ' '; echo
echo "prepare.sh: done. Calls: deps, stage c1..c$(( $(ls -d .gpu/c* | wc -l) - 1 )), then check (see bench/gpu/README.md)"
