//! The verbs transport in a build without the `verbs` feature: the device never opens (the
//! error says how to get verbs), so no verbs setup, net or endpoint can exist, and verbs
//! reaches no peer. The types that the transport contract names are uninhabited, which
//! makes every method below provably unreachable rather than a stub.

use crate::error::{Error, Result};
use crate::params::TransportChoice;
use crate::transport::{Descriptor, OpenCx, Opened, Transport, TransportKind, VerbsInfo};

/// The verbs transport, in a build without it.
#[derive(Debug)]
pub(crate) struct Verbs;

impl Transport for Verbs {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    /// As with the feature: `auto` keeps verbs for ranks on other hosts.
    fn allowed(&self, choice: TransportChoice, same_host: bool) -> bool {
        choice.named().map_or(!same_host, |k| k == TransportKind::Verbs)
    }

    /// Required, the feature error (which names the `verbs` feature and its build needs),
    /// published as the reason; under `auto`, nothing.
    fn open(&self, cx: &OpenCx<'_>, me: &mut Descriptor) -> Result<Opened> {
        if !cx.required {
            return Ok(Opened::No);
        }
        let e = Error::Verbs { rank: cx.rank, what: "open an RDMA device".into(), source: ferroccl_verbs::Error::FeatureDisabled };
        me.verbs = VerbsInfo::Failed(e.to_string());
        Ok(Opened::Failed(e))
    }

    /// Verbs reaches no peer in this build.
    fn can_connect(&self, _me: &Descriptor, _peer: &Descriptor) -> std::result::Result<(), String> {
        Err("this build lacks the `verbs` cargo feature".into())
    }
}

/// Uninhabited: no peer's window is read with RDMA READ without verbs.
#[derive(Debug)]
pub(crate) enum RemoteRegion {}

impl RemoteRegion {
    pub(crate) fn len(&self) -> u64 {
        match *self {}
    }
    pub(crate) fn revoke(&self) {
        match *self {}
    }
    pub(crate) fn writable(&self) -> bool {
        match *self {}
    }
    pub(crate) fn in_flight(&self) -> bool {
        match *self {}
    }
}

/// Uninhabited: no memory is registered with a device without verbs.
#[derive(Debug)]
pub(crate) enum UserMr {}
