//! The control protocol's messages and gRPC stubs, generated from `proto/lazarus_control.proto`
//! (`build.rs`): the controller's service ([`crate::service`]), the agents' client
//! ([`crate::agent`]) and the hub ([`crate::hub`]) share them.

tonic::include_proto!("lazarus.control.v1");
