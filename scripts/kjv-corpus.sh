# kjv-corpus.sh -- sourced by the demos (train-demo.sh, distill-demo.sh), from the repository
# root: installs the build dependencies and Debian's bible-kjv, builds build/kiln, fetches the
# default model and makes the King James Bible's token shard. Sets model (the default model's
# GGUF) and work (the demo folder, $KILN_DEMO_DIR or ~/.cache/kiln/demo, holding kjv.txt and
# kjv.tok).
bash scripts/setup-deps.sh
dpkg-query -W -f='${Status}' bible-kjv 2>/dev/null | grep -q "install ok installed" || {
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bible-kjv >/dev/null
}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target kiln >/dev/null
model="$(bash scripts/fetch-model.sh)"
work="${KILN_DEMO_DIR:-$HOME/.cache/kiln/demo}"
mkdir -p "$work"
[ -s "$work/kjv.txt" ] || bible gen1:1-rev22:21 > "$work/kjv.txt"
[ -s "$work/kjv.tok" ] || ./build/kiln data -m "$model" -o "$work/kjv.tok" "$work/kjv.txt"
