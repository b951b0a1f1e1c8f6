#!/usr/bin/env bash
# A clean copy of the committed tree for a device call: build/snap (git-ignored), made with
# `git archive HEAD`, so that uncommitted edits never reach a measurement, with the commit it
# holds in build/snap/.snapshot-commit (gpu_check.sh prints it: a device machine's own .git may
# be of an older checkout). Carry "build/snap" (and "device-wheels") and run, on the device:
#   cd build/snap && cp -r ../../device-wheels . && bash scripts/gpu_check.sh STEP ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf build/snap
mkdir -p build/snap
git archive HEAD | tar x -C build/snap
git log -1 --format='%h %s' > build/snap/.snapshot-commit
echo "build/snap: $(cat build/snap/.snapshot-commit)"
