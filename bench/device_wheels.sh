#!/bin/bash
# Fetch the wheels bench/device_wheels.txt names into .whl/ (ignored by git through .git/info/exclude),
# for the lent GPU machine's Python 3.12 on x86-64; `carry` .whl in each call of bench/gpu_waiting_list.sh.
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
platforms=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
grep -v '^#' bench/device_wheels.txt | while read -r requirement; do
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
        -d .whl "$requirement"
done
du -sh .whl
