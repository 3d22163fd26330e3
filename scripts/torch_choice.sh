#!/usr/bin/env bash
# The torch build set-up installs, as pure functions of what the machine says (sourced by
# scripts/setup.sh; tests/test_setup_sh.py calls them directly): nothing here runs a command.
# The CUDA builds PyTorch publishes for torch 2.12 and 2.13 (its RELEASE.md support matrix: review it
# with torch_version), newest first, as "CUDA index lowest-compute-capability highest-major": 12.6
# and 13.0 are stable, 13.2 is experimental (it covers the same GPUs as 13.0, so it is never needed);
# 12.8 is gone since 2.12. 13.0 carries PTX for its newest architecture, so newer GPUs (a GB10's
# 12.1) run it too; 12.6 stops at Hopper (9.0), and its aarch64 build starts at Ampere (8.0).
# $1: the machine (uname -m).
cuda_builds() {
    case "$1" in
        aarch64 | arm64) printf '%s\n' "13.0 cu130 8.0 any" "12.6 cu126 8.0 9" ;;
        *) printf '%s\n' "13.0 cu130 7.5 any" "12.6 cu126 5.0 9" ;;
    esac
}
# "X.Y" as one comparable number, X*100+Y.
version_number() { local major=${1%%.*} minor=${1#*.}; echo $((10#$major * 100 + 10#${minor%%.*})); }
# The newest build the driver can run (its CUDA version at most the driver's) that has code for
# every GPU here, as "CUDA index"; nothing where none fits. $1: the driver's CUDA version, $2: the
# GPUs' compute capabilities, $3: the machine.
cuda_build() {
    local driver=$1 caps=$2 machine=$3 cuda index lowest highest cap fits
    while read -r cuda index lowest highest; do
        [ "$(version_number "$cuda")" -le "$(version_number "$driver")" ] || continue
        fits=1
        for cap in $caps; do
            if [ "$(version_number "$cap")" -lt "$(version_number "$lowest")" ] ||
                { [ "$highest" != any ] && [ "${cap%%.*}" -gt "$highest" ]; }; then
                fits=0
            fi
        done
        [ "$fits" = 1 ] && echo "$cuda $index" && return 0
    done < <(cuda_builds "$machine")
    return 0
}
# What set-up installs: "cpu" (the registry's CPU build) where there is no GPU ($1 "no": nvidia-smi
# absent or seeing none, or TPSERVE_DEVICE=cpu), else "cuda CUDA INDEX" for the build cuda_build
# picks, or "none" where no build fits. $2..$4 as cuda_build's.
torch_choice() {
    local gpu=$1 build
    if [ "$gpu" != yes ]; then
        echo cpu
        return 0
    fi
    build=$(cuda_build "$2" "$3" "$4")
    if [ -z "$build" ]; then echo none; else echo "cuda $build"; fi
}
