//! Builds the kernels twice over: always as host code for the emulator (the tests run every
//! kernel on the CPU), and with the `cuda` feature as PTX by nvcc, for the compute capability in
//! CUDA_COMPUTE_CAP (default 90: H100/H200).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    for f in [
        "cuda/kernels.cu",
        "cuda/common.cuh",
        "cuda/attention.cuh",
        "cuda/attention_mma.cuh",
        "cuda/elementwise.cuh",
        "cuda/norm.cuh",
        "cuda/rope.cuh",
        "cuda/rows.cuh",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    for f in ["emulator/emulate.h", "emulator/emulate.cpp", "emulator/kernels_emu.cpp"] {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    // CUDA code reads memory through pointers of other types (bf16 pairs as one u32, rows as
    // uint4) as nvcc allows; a host compiler's strict-aliasing assumptions would reorder those
    // reads around the writes of the same memory.
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .flag("-fno-strict-aliasing")
        .file("emulator/kernels_emu.cpp")
        .warnings(false)
        .compile("lazarus_kernels_emu");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.ptx");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new("nvcc")
        .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "cuda/kernels.cu", "-o"])
        .arg(&out)
        .status()
        .expect("the cuda feature needs nvcc on the PATH (build with scripts/cargo-cuda)");
    assert!(status.success(), "nvcc failed on cuda/kernels.cu");
}
