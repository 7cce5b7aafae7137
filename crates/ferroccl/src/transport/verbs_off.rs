//! The verbs transport in a build without the `verbs` feature: the device never opens (the
//! error says how to get verbs), so no verbs setup, mesh or endpoint can exist. The types
//! are uninhabited, which makes every method below provably unreachable rather than a stub.

use std::sync::Arc;
use std::time::Instant;

use ferroccl_mem::region::RegionHandle;

use crate::error::{Error, Result};
use crate::params::Params;
use crate::transport::{Connected, Descriptor, ReadReq, RemoteBuf, SetupCx, VerbsInfo, WriteReq};

/// Verbs reaches no peer in this build.
pub(crate) fn can_connect(_me: &Descriptor, _peer: &Descriptor) -> std::result::Result<(), String> {
    Err("this build lacks the `verbs` cargo feature".into())
}

/// No device can be opened in this build.
#[derive(Debug)]
pub(crate) enum VerbsSetup {}

impl VerbsSetup {
    /// Always the feature error (which names the `verbs` feature and its build needs).
    pub(crate) fn open(rank: usize, _size: usize, _params: &Params) -> Result<VerbsSetup> {
        Err(Error::Verbs { rank, what: "open an RDMA device".into(), source: ferroccl_verbs::Error::FeatureDisabled })
    }

    pub(crate) fn info(&self) -> Result<VerbsInfo> {
        match *self {}
    }

    pub(crate) fn connect(self, _cx: &SetupCx<'_>, _peers: &[usize]) -> Result<(Arc<VerbsNet>, Connected)> {
        match self {}
    }
}

/// Uninhabited: there is no verbs mesh without a device.
#[derive(Debug)]
pub(crate) enum VerbsNet {}

impl VerbsNet {
    pub(crate) fn poll(&self) -> Result<bool> {
        match *self {}
    }

    pub(crate) fn write_bytes(&self) -> (u64, u64) {
        match *self {}
    }

    pub(crate) fn read_bytes(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn window_write_bytes(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn inbox(&self) -> &Arc<crate::inbox::Inbox> {
        match *self {}
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

/// Uninhabited (see [`VerbsNet`]).
#[derive(Debug)]
pub(crate) enum UserMr {}

pub(crate) fn region_info(mr: &UserMr) -> (u64, u32, u64) {
    match *mr {}
}

pub(crate) fn register_user(net: &VerbsNet, _h: &RegionHandle, _offset: usize, _len: usize) -> Result<(RemoteBuf, UserMr)> {
    match *net {}
}

pub(crate) fn register_window(net: &VerbsNet, _h: &RegionHandle, _writable: bool) -> Result<UserMr> {
    match *net {}
}

pub(crate) fn register_source(net: &VerbsNet, _h: &RegionHandle, _offset: usize, _len: usize) -> Result<Arc<UserMr>> {
    match *net {}
}

pub(crate) fn wait_unused(net: &VerbsNet, _mr: &Arc<UserMr>, _deadline: Instant) -> bool {
    match *net {}
}

/// Never built: it needs a [`VerbsNet`], which cannot exist.
#[derive(Debug)]
pub(crate) struct VerbsEndpoint {
    net: Arc<VerbsNet>,
}

impl VerbsEndpoint {
    pub(crate) fn net(&self) -> &Arc<VerbsNet> {
        &self.net
    }
    pub(crate) fn to(net: &Arc<VerbsNet>, _peer: usize) -> VerbsEndpoint {
        match **net {}
    }
    pub(crate) fn is_dead(&self) -> bool {
        match *self.net {}
    }
    pub(crate) fn remote_region(&self, _addr: u64, _rkey: u32, _len: u64, _writable: bool) -> Arc<RemoteRegion> {
        match *self.net {}
    }
    pub(crate) fn post_read(
        &self,
        _region: &Arc<RemoteRegion>,
        _dst: &Arc<UserMr>,
        _r: &ReadReq,
        _deadline: Instant,
        _poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        match *self.net {}
    }
    pub(crate) fn post_write_to(
        &self,
        _region: &Arc<RemoteRegion>,
        _src: &Arc<UserMr>,
        _r: &ReadReq,
        _deadline: Instant,
        _poll: &dyn Fn() -> Result<()>,
    ) -> Result<bool> {
        match *self.net {}
    }
    pub(crate) fn max_send(&self) -> usize {
        match *self.net {}
    }
    pub(crate) fn post_send(&self, _msg: &[u8], _deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<()> {
        match *self.net {}
    }

    pub(crate) fn post_send2(&self, _head: &[u8], _body: &[u8], _deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<()> {
        match *self.net {}
    }
    pub(crate) fn try_post_send_now(&self, _msg: &[u8]) -> Result<()> {
        match *self.net {}
    }
    pub(crate) fn post_write(&self, _w: &WriteReq<'_>, _deadline: Instant, _poll: &dyn Fn() -> Result<()>) -> Result<()> {
        match *self.net {}
    }
    pub(crate) fn cut(&self) {
        match *self.net {}
    }
    pub(crate) fn close(&self, _deadline: Instant, _poll: &dyn Fn() -> Result<()>) {
        match *self.net {}
    }
}
