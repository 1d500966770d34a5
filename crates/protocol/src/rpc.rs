//! What every gRPC side of a job shares: its runtime, and what a failed call says.

use crate::error::ControlError;

/// A runtime of `threads` threads named `name`, for the gRPC server and the agent's client.
pub fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime, ControlError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| ControlError::io(format!("starting the {name} runtime"), e))
}

/// What a failed call says: the status's message, and the transport's causes under it (a TLS
/// alert: a certificate the controller did not take).
pub fn status_error(e: &tonic::Status) -> String {
    match std::error::Error::source(e) {
        Some(source) if e.code() != tonic::Code::Unauthenticated => format!("{} ({})", e.message(), error_chain(source)),
        _ => e.message().to_string(),
    }
}

/// An error with its causes, `: `-separated (a transport error's own text is only "transport
/// error").
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
