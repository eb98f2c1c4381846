#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the project root (prepare.sh copies it to .gpu/bin/).
#   bash .gpu/bin/device.sh deps          install .gpu/deps (carry .gpu/bin and .gpu/deps)
#   bash .gpu/bin/device.sh stage .gpu/cN append vLLM part N (carry .gpu/bin and .gpu/cN), N = 1, 2, ...
#   bash .gpu/bin/device.sh vllm          check the staged wheel and install it
#   bash .gpu/bin/device.sh check .gpu/cN OUT.json
#                                         the last part, vLLM and bench/gpu_check.sh in one call (carry .gpu/bin, .gpu/cN)
#   . /tmp/gpu-env.sh                     then: PYTHONPATH and vLLM's env, in every later command
# State lives in /tmp/stage and /tmp/site: it survives only while the machine stays warm
# (30 s after each call), so make the calls back to back.
set -u
S=/tmp/stage; SITE=/tmp/site; mkdir -p $S $SITE
W=$S/vllm-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl
SHA=c82e96b01af2142ef398ca92f1e9c5f4ffc119f2cc09fe68ea28865323532f0c
PIP=(python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target $SITE)
cat > /tmp/gpu-env.sh <<ENV
export PYTHONPATH=$SITE:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not installed; vLLM's torch sampler is used
export PYTHONUNBUFFERED=1
ENV
case "${1:-}" in
  deps)
    "${PIP[@]}" .gpu/deps/*.whl 2>&1 | grep -v 'Target directory' | tail -3
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation .gpu/deps/deepspeed-0.19.8.tar.gz 2>&1 | tail -3
    PYTHONPATH=$SITE python3 -c "import deepspeed, submitit, torch; print('deps ok: deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    rm -f $S/vllm.part; touch $S/vllm.part ;;
  stage)
    [ -f $S/vllm.part ] || { echo "device.sh: no $S/vllm.part: the machine went cold; start again with 'deps'"; exit 3; }
    n=${2##*c}; have=$(ls $S/done.* 2>/dev/null | wc -l)
    [ "$have" = "$((n-1))" ] || { echo "device.sh: part $n out of order ($have parts staged; the machine may have gone cold)"; exit 3; }
    cat "$2"/part* >> $S/vllm.part && touch $S/done.$n && echo "staged part $n: $(stat -c %s $S/vllm.part) bytes" ;;
  vllm)
    if [ ! -f $SITE/vllm/__init__.py ]; then
      mv $S/vllm.part $W 2>/dev/null
      echo "$SHA  $W" | sha256sum -c --quiet || { echo "device.sh: vLLM wheel checksum wrong (parts missing?)"; exit 4; }
      "${PIP[@]}" $W 2>&1 | grep -v 'Target directory' | tail -3
    fi
    PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 -c "import vllm; from vllm.v1.engine.async_llm import AsyncLLM; print('vllm ok', vllm.__version__)" ;;
  check)
    bash "$0" stage "$2" && bash "$0" vllm || exit $?
    . /tmp/gpu-env.sh && bash bench/gpu_check.sh "${3:?usage: device.sh check .gpu/cN OUT.json}" ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
