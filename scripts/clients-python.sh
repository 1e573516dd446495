# Sourced, not run: a CPython >= 3.12 for the trainer clients that need one (SkyRL 0.4.0's wheel says
# Requires-Python >=3.12,<3.15), found or made from what a fresh machine reaches: PyPI, Debian's archive, npm.
#
# In order:
#   1. $LIFEGUARD_CLIENTS_PYTHON, when set;
#   2. python3.13, python3.12 or python3.14 on PATH;
#   3. Debian's own python3.13 package, when apt has a candidate for it (Debian 13 and later);
#   4. otherwise (Debian 12: apt has no Python newer than 3.11, PyPI ships no CPython, and npm's portable
#      Pythons download from GitHub at install) CPython 3.13 built from Debian 13's python3.13 source
#      package: `apt-get source` with a private apt configuration (the machine's own sources are not
#      touched), checked by apt against Debian's signed Release file, built with the toolchain and -dev
#      libraries of the machine's own release (about 3-4 min on 2 cores, once) into
#        ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/cpython-3.13-<hash of this file>
#      (override with LIFEGUARD_CLIENTS_PYTHON_HOME); a marker written last makes a second run reuse it.

_CPY_SERIES=3.13
_CPY_DEBIAN_SUITE=trixie

_cpy_log() { echo "[clients-python $(date +%T)] $*" >&2; }

# _cpy_fits PYTHON: true when PYTHON runs and is 3.12, 3.13 or 3.14 with venv and ssl.
_cpy_fits() {
  "$1" - <<'PY' >/dev/null 2>&1
import ssl, sys, venv
raise SystemExit(0 if (3, 12) <= sys.version_info[:2] < (3, 15) else 1)
PY
}

# clients_python: print the interpreter's path on stdout; progress on stderr; non-zero if none can be had.
clients_python() {
  local candidate home marker key
  if [[ -n ${LIFEGUARD_CLIENTS_PYTHON:-} ]]; then
    if _cpy_fits "$LIFEGUARD_CLIENTS_PYTHON"; then echo "$LIFEGUARD_CLIENTS_PYTHON"; return 0; fi
    _cpy_log "LIFEGUARD_CLIENTS_PYTHON=$LIFEGUARD_CLIENTS_PYTHON is not a CPython 3.12-3.14 with venv and ssl"
    return 1
  fi
  for candidate in python3.13 python3.12 python3.14; do
    if command -v "$candidate" >/dev/null && _cpy_fits "$(command -v "$candidate")"; then
      command -v "$candidate"
      return 0
    fi
  done
  key=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
  home=${LIFEGUARD_CLIENTS_PYTHON_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/cpython-$_CPY_SERIES-$key}
  marker=$home/.lifeguard-ready
  if [[ -f $marker ]] && _cpy_fits "$home/bin/python$_CPY_SERIES"; then
    echo "$home/bin/python$_CPY_SERIES"
    return 0
  fi
  if [[ $(id -u) -ne 0 ]] && ! command -v sudo >/dev/null; then
    _cpy_log "no CPython >= 3.12 on PATH, and installing one needs root (apt-get)"
    return 1
  fi
  _cpy_debian_package && { command -v "python$_CPY_SERIES"; return 0; }
  mkdir -p "$(dirname "$home")" || return 1
  (
    flock 9
    if [[ ! -f $marker ]]; then _cpy_build "$home" || exit 1; fi
  ) 9>"$home.lock" || return 1
  echo "$home/bin/python$_CPY_SERIES"
}

_cpy_sudo() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# Debian's own python3.13 (with its venv module), where the machine's apt offers it.
_cpy_debian_package() {
  local candidate
  candidate=$(apt-cache policy "python$_CPY_SERIES" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  if [[ -z $candidate || $candidate == "(none)" ]]; then
    _cpy_sudo apt-get update -qq >/dev/null 2>&1 || true
    candidate=$(apt-cache policy "python$_CPY_SERIES" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  fi
  [[ -n $candidate && $candidate != "(none)" ]] || return 1
  _cpy_log "installing Debian's python$_CPY_SERIES $candidate"
  DEBIAN_FRONTEND=noninteractive _cpy_sudo apt-get install -y -qq --no-install-recommends \
    "python$_CPY_SERIES" "python$_CPY_SERIES-venv" >/dev/null || return 1
  _cpy_fits "$(command -v "python$_CPY_SERIES")"
}

# CPython from Debian 13's python3.13 source package, built for this machine into $1.
_cpy_build() {
  local home=$1 work apt_dir orig src t0=$SECONDS
  local -a apt_opts build_deps missing=()
  work=$(mktemp -d "${TMPDIR:-/tmp}/lifeguard-cpython.XXXXXX") || return 1
  apt_dir=$work/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
  echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $_CPY_DEBIAN_SUITE main" \
    >"$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=$apt_dir/none"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir" -o "APT::Sandbox::User=root")
  build_deps=(gcc make libc6-dev libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev
              libreadline-dev libncurses-dev uuid-dev xz-utils)
  for pkg in "${build_deps[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    _cpy_log "apt-get install ${missing[*]}"
    { _cpy_sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive _cpy_sudo apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >"$work/apt-install.log" 2>&1 \
      || { _cpy_log "installing the build dependencies failed:"; tail -20 "$work/apt-install.log" >&2; return 1; }
  fi
  _cpy_log "apt-get source python$_CPY_SERIES (Debian $_CPY_DEBIAN_SUITE), into $work"
  { apt-get "${apt_opts[@]}" update -qq && (cd "$work" && apt-get "${apt_opts[@]}" source --download-only -qq \
      "python$_CPY_SERIES"); } >"$work/apt-source.log" 2>&1 \
    || { _cpy_log "apt-get source failed:"; tail -20 "$work/apt-source.log" >&2; return 1; }
  orig=$(compgen -G "$work/python${_CPY_SERIES}_*.orig.tar.xz" | head -1)
  [[ -n $orig ]] || { _cpy_log "no orig tarball in $work"; return 1; }
  tar -xJf "$orig" -C "$work" || return 1
  src=$(compgen -G "$work/Python-$_CPY_SERIES.*" | head -1)
  _cpy_log "building $(basename "$src") into $home (about 3-4 min on 2 cores)"
  rm -rf "$home"
  { (cd "$src" && ./configure -q --prefix="$home" --with-ensurepip=install && nice -n 10 make -s -j"$(nproc)" \
      && make -s install); } >"$work/build.log" 2>&1 \
    || { _cpy_log "the build failed:"; tail -30 "$work/build.log" >&2; return 1; }
  _cpy_fits "$home/bin/python$_CPY_SERIES" || { _cpy_log "the built interpreter lacks venv or ssl"; return 1; }
  echo "$(basename "$src") built from Debian $_CPY_DEBIAN_SUITE's python$_CPY_SERIES source" >"$home/.lifeguard-ready"
  rm -rf "$work"
  _cpy_log "ready in $((SECONDS - t0)) s: $home/bin/python$_CPY_SERIES"
}
