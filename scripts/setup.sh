#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine (what `make test` and `make demo` run first).
#   scripts/setup.sh            Python venv (.venv) with ingero and its dev tools
#   scripts/setup.sh --system   also, as root: apt packages (bcc, kernel headers, faketime, iproute2,
#                               nftables), kernel-header links for bcc, tracefs
set -euo pipefail
cd "$(dirname "$0")/.."

SYSTEM=0
[[ "${1:-}" == "--system" ]] && SYSTEM=1
say() { printf 'setup: %s\n' "$*" >&2; }

APT_PACKAGES=(python3-bpfcc bpfcc-tools linux-headers-amd64 faketime iproute2 nftables iptables sqlite3 openssh-server pdsh gcc make libc6-dev prometheus
  chromium chromium-driver libnss3-tools  # these three: the dashboard's browser tests (Selenium)
  clickhouse-server clickhouse-client)  # tests/test_clickhouse.py: a 2-shard cluster on its own ports

system_setup() {
  if [[ $(id -u) -ne 0 ]]; then
    say "not root: skipping system packages (eBPF and netns tests will be skipped)"
    return 0
  fi
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # bcc compiles against /lib/modules/$(uname -r)/{build,source}; on kernels without a matching
  # headers package, point them at Debian's newest headers (BTF/CO-RE covers the differences).
  local mod="/lib/modules/$(uname -r)"
  if [[ ! -e "$mod/build/include/generated" ]]; then
    local hdr common
    hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    common=${hdr%-amd64}-common
    if [[ -n "$hdr" && -d "$common" ]]; then
      mkdir -p "$mod"
      ln -sfn "$hdr" "$mod/build"
      ln -sfn "$common" "$mod/source"
      say "linked $mod/build -> $hdr"
    fi
  fi
  if [[ ! -e /sys/kernel/tracing/events ]] && ! mountpoint -q /sys/kernel/tracing 2>/dev/null; then
    mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null && say "mounted tracefs" || true
  fi
  if [[ ! -e /sys/kernel/debug/tracing ]] && ! mountpoint -q /sys/kernel/debug 2>/dev/null; then
    mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
  fi
}

venv_setup() {
  local py=${PYTHON:-python3}
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "need Python >= 3.11 (found: $("$py" --version 2>&1))"; exit 1
  fi
  if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv"
    "$py" -m venv .venv
  fi
  local stamp=.venv/.ingero-installed
  if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
    say "installing ingero and dev tools into .venv (log: .venv/pip.log)"
    if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip \
           && .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]'; } >.venv/pip.log 2>&1; then
      tail -n 20 .venv/pip.log >&2
      say "pip install failed (full log: .venv/pip.log)"; exit 1
    fi
    touch "$stamp"
  fi
  # Perfetto's trace processor (the export test loads traces with it) is a binary the perfetto package
  # downloads from Google's storage on first use; where that host is unreachable the test says so and skips.
  if [[ -z "${INGERO_TRACE_PROCESSOR:-}" ]] && ! timeout 60 .venv/bin/python -c '
from perfetto.prebuilts.manifests.trace_processor_shell import TRACE_PROCESSOR_SHELL_MANIFEST as M
from perfetto.prebuilts.perfetto_prebuilts import get_perfetto_prebuilt
get_perfetto_prebuilt(M)' >/dev/null 2>&1; then
    say "Perfetto trace_processor_shell cannot be downloaded here: the export test that loads traces with it will skip"
  fi
  # The Python-frames bpf test runs under CPython 3.10, 3.11 and 3.12. Debian 12 packages 3.11 only; uv and
  # pyenv fetch interpreters from GitHub / python.org, which CI's machine cannot reach (its skip says so).
  local v
  for v in 3.10 3.12; do
    command -v "python$v" >/dev/null || say "python$v not on PATH (not packaged by Debian 12): its Python-frames test will skip"
  done
  # bcc lives in Debian's dist-packages; expose only the bcc package to the venv.
  local site shim=.venv/bcc-shim
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [[ -d /usr/lib/python3/dist-packages/bcc ]]; then
    mkdir -p "$shim"
    ln -sfn /usr/lib/python3/dist-packages/bcc "$shim/bcc"
    echo "$(pwd)/$shim" > "$site/ingero-bcc.pth"
  fi
}

((SYSTEM)) && system_setup
venv_setup
