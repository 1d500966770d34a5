//! An agent attaching to its controller: connect (retrying until a deadline), the challenge,
//! the hello that proves the job's secret, the welcome that proves it back. The first attach of
//! an agent and each re-attach after its controller was lost go the same way; a re-attach's
//! hello carries the agent's place in the job ([`proto::Rejoin`]).

use lazarus_setting::Setting;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use lazarus_comm::auth;
use lazarus_protocol::proto::{self, agent_message, controller_message, AgentMessage, ControllerMessage};
use lazarus_protocol::tls::ClientTls;
use lazarus_protocol::ControlError;

/// What an agent says of itself in every hello.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub controller: SocketAddr,
    /// The controller's address as given (the TLS name).
    pub controller_name: String,
    pub gpus: usize,
    pub host: IpAddr,
    pub secret: u128,
    pub tls: ClientTls,
}

/// An open session: where to send, what comes back, and the controller's welcome.
pub(crate) struct Session {
    pub out: UnboundedSender<AgentMessage>,
    pub inbound: tonic::Streaming<ControllerMessage>,
    pub job_id: String,
    pub welcome: proto::Welcome,
}

/// Why a session could not be opened.
#[derive(Debug)]
pub(crate) enum SessionError {
    /// Nobody answered as a controller before the deadline (none listening, a port that never
    /// speaks): worth trying again, for an agent that waits for a controller to come back.
    Unreachable(ControlError),
    /// A controller answered and refused this agent, or could not prove the job's secret.
    Refused(ControlError),
}

impl SessionError {
    pub fn into_error(self) -> ControlError {
        match self {
            SessionError::Unreachable(e) | SessionError::Refused(e) => e,
        }
    }
}

/// [`open`] tried again while the controller is unreachable (none listening yet, or the attach
/// cut among many under way from one address) until `within` has passed, `pause` between tries.
pub(crate) async fn open_retrying(me: &Identity, within: Duration, pause: Duration) -> Result<Session, ControlError> {
    let until = Instant::now() + within;
    loop {
        let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match open(me, left, None).await {
            Err(SessionError::Unreachable(_)) if Instant::now() + pause < until => tokio::time::sleep(pause).await,
            other => return other.map_err(SessionError::into_error),
        }
    }
}

/// Open a session with the controller, trying until `within` has passed; `rejoin`: this agent's
/// place in a running job whose controller was lost, and since when it was lost.
pub(crate) async fn open(me: &Identity, within: Duration, rejoin: Option<(proto::Rejoin, Instant)>) -> Result<Session, SessionError> {
    use SessionError::{Refused, Unreachable};
    let controller = me.controller;
    let refused = Arc::new(AtomicBool::new(false));
    let endpoint =
        me.tls.endpoint(&me.controller_name, refused.clone()).map_err(Refused)?.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true);
    let deadline = tokio::time::Instant::now() + within;
    let silent_port = || {
        ControlError::Launch(format!(
            "the controller at {controller} did not answer within {} s ({}): is it a Lazarus controller?",
            within.as_secs_f64(),
            Setting::ConnectTimeout
        ))
    };
    let channel = loop {
        // The TLS handshake too is bounded: a port that accepts and never answers is given up
        // at the deadline.
        let e = match tokio::time::timeout_at(deadline, endpoint.connect()).await {
            Ok(Ok(c)) => break c,
            Ok(Err(e)) => lazarus_protocol::rpc::error_chain(&e),
            Err(_) => return Err(Unreachable(silent_port())),
        };
        if refused.load(Ordering::Relaxed) {
            return Err(Refused(ControlError::Launch(format!(
                "the server at {controller} is not this job's controller: it does not hold the key the job's secret gives (another job's, or a different {}; a controller serving an operator's certificate needs {})", Setting::SecretFile, Setting::TlsCa
            ))));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Unreachable(ControlError::Launch(format!(
                "cannot reach the controller at {controller} within {} s: {e}",
                within.as_secs_f64()
            ))));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // A node's start carries the job's replica map: megabytes at a thousand nodes (gRPC's
    // default limit, 4 MiB, is met at about 1,000 nodes of 8).
    let mut client = proto::control_client::ControlClient::new(channel).max_decoding_message_size(lazarus_protocol::MAX_CONTROL_MESSAGE);
    let (out, out_rx) = tokio::sync::mpsc::unbounded_channel::<AgentMessage>();
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx);
    // A port that takes the connection but never speaks gRPC is given up at the deadline.
    let answer_within = within.max(Duration::from_secs(1));
    let refusal = |why: String| Refused(ControlError::Launch(format!("the controller at {controller} refused this agent: {why}")));
    // A controller that says why it refuses refuses; a stream cut in the handshake (the
    // controller lost on the way, or a connection it closed among many under way from one
    // address: it holds 32 handshakes per address) is worth trying again.
    let refused_or_cut = |e: tonic::Status| match e.code() {
        tonic::Code::PermissionDenied
        | tonic::Code::InvalidArgument
        | tonic::Code::ResourceExhausted
        | tonic::Code::FailedPrecondition
        | tonic::Code::DeadlineExceeded => refusal(e.message().to_string()),
        _ => {
            Unreachable(ControlError::Launch(format!("the controller at {controller} was lost while this agent attached: {}", e.message())))
        }
    };
    let mut inbound = match tokio::time::timeout_at(deadline, client.attach(stream)).await {
        Err(_) => return Err(Unreachable(silent_port())),
        Ok(Err(e)) => return Err(refused_or_cut(e)),
        Ok(Ok(reply)) => reply.into_inner(),
    };
    // The controller's challenge, this agent's hello that answers it, and the welcome that
    // proves the controller knows the secret too: the secret itself never crosses the network.
    let silent = |what: &str| {
        Unreachable(ControlError::Launch(format!(
            "no {what} from the controller at {controller} within {} s ({})",
            answer_within.as_secs_f64(),
            Setting::ConnectTimeout
        )))
    };
    let challenge = match tokio::time::timeout(answer_within, inbound.message()).await {
        Ok(Ok(Some(ControllerMessage { body: Some(controller_message::Body::Challenge(c)), .. }))) => c.nonce,
        Ok(Err(e)) => return Err(refused_or_cut(e)),
        Ok(Ok(None)) => return Err(refusal("the controller ended the session".into())),
        _ => return Err(silent("challenge")),
    };
    let nonce = auth::nonce().map_err(|e| Refused(ControlError::io("drawing a nonce from /dev/urandom", e)))?;
    let mut hello = proto::AgentHello {
        proof: Vec::new(),
        nonce: nonce.to_vec(),
        gpus: me.gpus as u32,
        host: me.host.to_string(),
        pid: std::process::id(),
        rejoin: rejoin.map(|(r, since)| proto::Rejoin { orphaned_ms: since.elapsed().as_millis() as u64, ..r }),
    };
    hello.proof = auth::prove(me.secret, &lazarus_protocol::handshake::hello_context(&hello), &challenge, &nonce).to_vec();
    let _ = out.send(AgentMessage { job_id: String::new(), epoch: 0, body: Some(agent_message::Body::Hello(hello)) });
    let (job_id, welcome) = match tokio::time::timeout(answer_within, inbound.message()).await {
        Ok(Ok(Some(ControllerMessage { job_id, body: Some(controller_message::Body::Welcome(w)), .. }))) => (job_id, w),
        Ok(Err(e)) => return Err(refused_or_cut(e)),
        Ok(Ok(None)) => return Err(refusal("the controller ended the session".into())),
        _ => return Err(silent("welcome")),
    };
    if !auth::verify(me.secret, &lazarus_protocol::handshake::welcome_context(welcome.agent), &nonce, &challenge, &welcome.proof) {
        return Err(Refused(ControlError::Launch(format!(
            "the controller at {controller} did not prove it knows the job's secret: not this job's controller"
        ))));
    }
    Ok(Session { out, inbound, job_id, welcome })
}
