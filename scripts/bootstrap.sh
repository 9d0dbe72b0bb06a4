#!/usr/bin/env bash
# Make a fresh machine ready: system packages, the venv with fleetd and its ctl (fleetctl, the TUI),
# test and ansible extras, the pinned llama.cpp tools, stock and with the client patch, the native
# and the portable ggml libraries (cached in ~/.cache/fleetd).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ip >/dev/null || need+=(iproute2)
command -v pkill >/dev/null || need+=(procps)
command -v groff >/dev/null || need+=(groff-base)
command -v mandoc >/dev/null || need+=(mandoc)
# the compute workers' seccomp filter (fleetd/compute/sandbox.py loads it with ctypes)
ldconfig -p 2>/dev/null | grep -q "libseccomp.so.2 " || need+=(libseccomp2)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing system packages: ${need[*]}" >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77" wheel >&2
.venv/bin/python -m pip install -q -e '.[ctl,test,ansible]' >&2

bash scripts/build-llama.sh >/dev/null
# The portable ggml build fleetctl deploy ships (lib-portable/): after the native one, never beside
# it (same source tree, two cores). Two variants keep CI short: x64 runs on any x86-64 CPU,
# haswell (AVX2) is what most of them score best; FLEETD_GGML_VARIANTS="" builds all 14 (and
# other architectures build all of theirs).
variants=""
[ "$(uname -m)" = x86_64 ] && variants="x64 haswell"
FLEETD_GGML_PORTABLE=1 FLEETD_GGML_VARIANTS="${FLEETD_GGML_VARIANTS-$variants}" \
    bash scripts/build-llama.sh ggml >/dev/null
bash scripts/build-llama-p2p.sh >/dev/null
