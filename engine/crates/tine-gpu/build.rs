//! With the `cuda` feature: compiles kernels/decode.cu with nvcc into sm machine code (a cubin)
//! for `CUDA_COMPUTE_CAP` (default 90: H100/H200, built as sm_90a), which src/cuda.rs embeds.
//! nvcc is `$NVCC`, else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on the PATH (tools/cuda/build.sh
//! sets them from its PyPI toolkit). Without the feature there is nothing to build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels/decode.cu");
    for var in ["NVCC", "CUDA_ROOT", "CUDA_COMPUTE_CAP", "CARGO_FEATURE_CUDA"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".to_string());
    // Hopper's own instructions need the `a` target; other capabilities take the plain one.
    let sm = if cap == "90" { "90a".to_string() } else { cap.clone() };
    let nvcc = std::env::var("NVCC").ok().or_else(|| std::env::var("CUDA_ROOT").ok().map(|r| format!("{r}/bin/nvcc"))).unwrap_or_else(|| "nvcc".to_string());
    let cubin = out.join("decode.cubin");
    let status = Command::new(&nvcc)
        .args(["-cubin", "-O3", "-std=c++17", &format!("-gencode=arch=compute_{sm},code=sm_{sm}"), "-o"])
        .arg(&cubin)
        .arg("kernels/decode.cu")
        .status()
        .unwrap_or_else(|e| panic!("tine-gpu: cannot run nvcc ({nvcc}): {e}; set NVCC or CUDA_ROOT, or build with tools/cuda/build.sh"));
    assert!(status.success(), "tine-gpu: nvcc ({nvcc}) failed on kernels/decode.cu");
    println!("cargo:rustc-env=TINE_GPU_SM={sm}");
}
