//! The control protocol's messages and gRPC stubs, generated from `proto/lazarus_control.proto`
//! (`build.rs`): the controller's service (in `lazarus-controller`), the agents' client
//! (`lazarus-agent`) and the hub (`lazarus-controller`) share them.

tonic::include_proto!("lazarus.control.v1");
