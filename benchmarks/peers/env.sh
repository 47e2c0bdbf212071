# Sourced by every peer script: where the peer venvs live and where caches go (all under /tmp, never ~/.cache).
PEERS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENVS="$PEERS_DIR/venvs"
PEER_CACHE="${PEER_CACHE:-/tmp/kvstrata-peers-cache}"
export PIP_CACHE_DIR="$PEER_CACHE/pip" XDG_CACHE_HOME="$PEER_CACHE/xdg" HF_HOME="$PEER_CACHE/hf" \
       VLLM_CACHE_ROOT="$PEER_CACHE/vllm" MPLCONFIGDIR="$PEER_CACHE/mpl" HF_HUB_OFFLINE=1 \
       PIP_DISABLE_PIP_VERSION_CHECK=1
PYTHON="${PYTHON:-python3.11}"
mkdir -p "$VENVS" "$PEER_CACHE"

# make_venv NAME: create $VENVS/NAME unless it exists; prints nothing.
make_venv() { test -x "$VENVS/$1/bin/python" || "$PYTHON" -m venv "$VENVS/$1"; }
