//! With the `cuda` feature: compile Lazarus's own CUDA kernels (src/ops/cuda/kernels.cu) to PTX
//! with nvcc (on the PATH: ../shared/gpu/cargo-cuda provides it), for the compute capability in
//! CUDA_COMPUTE_CAP (default 90: H100/H200). Without the feature there is nothing to build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/ops/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new("nvcc")
        .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "src/ops/cuda/kernels.cu", "-o"])
        .arg(&out)
        .status()
        .expect("the cuda feature needs nvcc on the PATH (build with ../shared/gpu/cargo-cuda)");
    assert!(status.success(), "nvcc failed on src/ops/cuda/kernels.cu");
}
