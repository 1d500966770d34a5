//! Generates the gRPC control protocol from `proto/` with a pure-Rust protobuf compiler
//! (protox): no `protoc` needed, nothing downloaded at build time.
fn main() {
    println!("cargo:rerun-if-changed=proto/lazarus_control.proto");
    let fds = protox::compile(["proto/lazarus_control.proto"], ["proto"]).expect("the control protocol compiles");
    // The lines sent to many agents are shared, not copied, until each stream encodes them.
    tonic_prost_build::configure()
        .bytes(".lazarus.control.v1.WorkerInput.message")
        .bytes(".lazarus.control.v1.StartWorkers.job")
        .bytes(".lazarus.control.v1.Piece.data")
        .compile_fds(fds)
        .expect("the control protocol's Rust code is generated");
}
