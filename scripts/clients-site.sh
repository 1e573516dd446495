# Sourced, not run: the cached site directory with the RL trainers' own client packages, shared by
# scripts/test-clients.sh (tests/clients, against the simulator) and scripts/test-vllm.sh
# (tests/vllm/test_vllm_clients.py, against a real vLLM).
#
# The trainers' packages pull in torch, Ray, vLLM and more, so they are installed with `pip install
# --no-deps` into a cached site directory, together with only the small packages their HTTP modules
# import. The tests import only those modules (tests/clients/stand_ins.py names the few package-level
# imports it stands in for). The directory lives outside the repo:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/clients-<hash of the pins and this file>
# (override with LIFEGUARD_CLIENTS_HOME; a group's site gets -GROUP after it); a marker written last makes a
# second run reuse it at once.
# prime-rl and vime are not on PyPI (checked with `pip index versions`), so they are not installed here.

# The trainers, the version the guides name (skyrl 0.3.0, trl, areal) for the project's Python (3.11).
CLIENT_TRAINERS=(skyrl==0.3.0 trl==1.16.0 areal==1.0.4)
# What their HTTP modules import beyond the proxy's own dev environment (aiohttp, openai, pydantic):
# TRL: requests (+ urllib3, certifi, charset-normalizer, idna); AReaL's http.py: httpx, tenacity,
# and colorlog through areal.utils.logging.
CLIENT_DEPS=(requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20
             httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 tenacity==9.2.1 colorlog==6.12.0)

# SkyRL 0.4.0 needs Python >= 3.12: its group installs with an interpreter from scripts/clients-python.sh into a
# site of its own (`client_site BIN skyrl04`). Beyond the proxy's environment its client modules import orjson,
# numpy and pybase64 (remote_inference_client.py, generate_wire.py), loguru and rich (the logging of modules on
# that import path) and requests (weight_sync/control_plane.py); torch and vLLM are stood in for
# (tests/clients/stand_ins.py, skyrl_trainer.py).
CLIENT_TRAINERS_SKYRL04=(skyrl==0.4.0)
CLIENT_DEPS_SKYRL04=(requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 idna==3.20
                     orjson==3.13.0 numpy==2.5.5 pybase64==1.5.1 loguru==0.7.3 rich==15.0.0 markdown-it-py==4.3.0
                     mdurl==0.1.2 pygments==2.21.0)

# client_site BIN_DIR [GROUP]: install the site of GROUP (default: the Python 3.11 one; skyrl04: SkyRL 0.4.0)
# with BIN_DIR/pip unless it is ready; print its path on stdout.
# Progress goes to stderr; returns non-zero (and prints nothing) if the install fails.
client_site() {
  local bin=$1 group=${2:-} key site marker
  local -a trainers=("${CLIENT_TRAINERS[@]}") deps=("${CLIENT_DEPS[@]}")
  if [[ $group == skyrl04 ]]; then
    trainers=("${CLIENT_TRAINERS_SKYRL04[@]}")
    deps=("${CLIENT_DEPS_SKYRL04[@]}")
  fi
  key=$( { echo "$group"; "$bin/python" -c 'import sys; print(sys.version_info[:2])'
           printf '%s\n' "${trainers[@]}" "${deps[@]}"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)
  if [[ -n ${LIFEGUARD_CLIENTS_HOME:-} ]]; then
    site=$LIFEGUARD_CLIENTS_HOME${group:+-$group}
  else
    site=${XDG_CACHE_HOME:-$HOME/.cache}/vllm-lifeguard/clients-${group:+$group-}$key
  fi
  marker=$site/.lifeguard-ready
  if [[ -f $marker ]]; then
    echo "[clients-site] reusing $site" >&2
    echo "$site"
    return 0
  fi
  mkdir -p "$(dirname "$site")" || return 1
  (
    flock 9
    if [[ ! -f $marker ]]; then
      echo "[clients-site] installing ${trainers[*]} (--no-deps) and ${#deps[@]} small deps into $site" >&2
      rm -rf "$site"
      "$bin/pip" install -q --disable-pip-version-check --no-deps --target "$site" \
        "${trainers[@]}" "${deps[@]}" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) >&2 || exit 1
      echo "$key" > "$marker"
    fi
  ) 9>"$site.lock" || return 1
  echo "$site"
}

# skyrl04_venv DIR: the venv SkyRL 0.4.0's tests run in (Python >= 3.12, scripts/clients-python.sh must be
# sourced), with the project and its test extra; remade when pyproject.toml or the interpreter changes.
skyrl04_venv() {
  local venv=$1 python stamp
  python=$(clients_python) || return 1
  stamp="$python $(sha256sum pyproject.toml | cut -c1-16)"
  if [[ -f $venv/.installed && $(cat "$venv/.installed") == "$stamp" ]]; then
    return 0
  fi
  echo "[clients-site] creating $venv with $python" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q --disable-pip-version-check -e '.[test]' \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) >&2 || return 1
  echo "$stamp" > "$venv/.installed"
}
