#!/usr/bin/env bash
# Install the peer loaders that scripts/benchmarks/bench_images.py compares against (all optional).
#
#   scripts/tools/install_peers.sh [all|dali|ffcv|basic]
#
# basic  torch DataLoader + Pillow, webdataset, the simplejpeg/OpenCV ceiling, dataset maker
# dali   NVIDIA DALI (a ~424 MB wheel; its CPU pipelines run without a GPU, device_id=None)
# ffcv   FFCV 1.0: needs libturbojpeg + OpenCV headers and pkg-config from the OS (Debian/Ubuntu
#        names below), numba, and is built against the installed numpy, hence
#        --no-build-isolation.  ffcv's metadata pulls in opencv-python (the GUI build) next to
#        opencv-python-headless; both own the same cv2/ directory, so the headless one is
#        reinstalled last to keep cv2 headless.
set -euo pipefail
what="${1:-all}"
PY="${PYTHON:-python}"

basic() {
    "$PY" -m pip install pillow simplejpeg opencv-python-headless webdataset tqdm scikit-image
}

dali() {
    "$PY" -m pip install nvidia-dali-cuda120
}

ffcv() {
    if command -v apt-get >/dev/null; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y \
            libturbojpeg0-dev libopencv-dev pkg-config
    else
        echo "install libturbojpeg, OpenCV (with headers) and pkg-config with your OS's" \
             "package manager first" >&2
    fi
    "$PY" -m pip install numba opencv-python-headless pillow
    "$PY" -m pip install --no-build-isolation ffcv
    cvver="$("$PY" -c 'import importlib.metadata as m; print(m.version("opencv-python-headless"))')"
    "$PY" -m pip install --force-reinstall --no-deps "opencv-python-headless==$cvver"
}

case "$what" in
    basic) basic ;;
    dali) dali ;;
    ffcv) ffcv ;;
    all) basic; dali; ffcv ;;
    *) echo "usage: $0 [all|dali|ffcv|basic]" >&2; exit 2 ;;
esac
"$PY" - <<'EOF'
for mod in ("PIL", "simplejpeg", "cv2", "webdataset", "nvidia.dali", "ffcv"):
    try:
        __import__(mod)
        print(f"{mod:12s} ok")
    except Exception as e:
        print(f"{mod:12s} unavailable: {type(e).__name__}: {e}")
EOF
