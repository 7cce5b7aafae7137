//! Devices, device contexts and port attributes.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use crate::{Error, Result};

/// The RDMA devices present on this host (`ibv_get_device_list`).
///
/// Devices must be opened while the list is alive; an opened [`Context`] outlives it.
pub struct DeviceList {
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    /// Lists the devices. No kernel RDMA support gives [`Error::NoDevice`].
    pub fn new() -> Result<Self> {
        let mut num: i32 = 0;
        // SAFETY: `num` is a valid out-pointer; the returned array is freed in `Drop`.
        let raw = unsafe { sys::ibv_get_device_list(&mut num) };
        let Some(list) = NonNull::new(raw) else {
            let source = io::Error::last_os_error();
            if source.raw_os_error() == Some(libc_enosys()) {
                return Err(Error::NoDevice);
            }
            return Err(Error::Verb { verb: "ibv_get_device_list", source });
        };
        Ok(Self { list, len: usize::try_from(num).unwrap_or(0) })
    }

    /// The number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no device.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices, in the order libibverbs lists them.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: `i < len`, and the array holds `len` valid device pointers while
            // the list is alive (the returned `Device` borrows the list).
            let dev = unsafe { *self.list.as_ptr().add(i) };
            Device { dev, _list: self }
        })
    }

    /// The device names.
    pub fn names(&self) -> Vec<String> {
        self.iter().map(|d| d.name()).collect()
    }

    /// The device called `name`.
    pub fn find(&self, name: &str) -> Result<Device<'_>> {
        if self.is_empty() {
            return Err(Error::NoDevice);
        }
        self.iter().find(|d| d.name() == name).ok_or_else(|| Error::DeviceNotFound { name: name.to_owned(), available: self.names() })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once; the devices
        // borrowed from it cannot outlive `self`, and opened contexts stay valid.
        unsafe { sys::ibv_free_device_list(self.list.as_ptr()) };
    }
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// `IBV_LINK_LAYER_ETHERNET` of `<infiniband/verbs.h>` (an anonymous enum that
/// rdma-sys does not bind).
const LINK_LAYER_ETHERNET: u8 = 2;

fn libc_enosys() -> i32 {
    rustix::io::Errno::NOSYS.raw_os_error()
}

/// One device of a [`DeviceList`].
#[derive(Clone, Copy)]
pub struct Device<'list> {
    dev: *mut sys::ibv_device,
    _list: &'list DeviceList,
}

impl Device<'_> {
    /// The kernel's name for the device, e.g. `mlx5_0` or `rxe0`.
    pub fn name(&self) -> String {
        // SAFETY: `dev` is valid while the list is; the name is a NUL-terminated string
        // owned by the device, copied out here.
        unsafe {
            let name = sys::ibv_get_device_name(self.dev);
            if name.is_null() {
                return String::new();
            }
            CStr::from_ptr(name).to_string_lossy().into_owned()
        }
    }

    /// The node GUID (host byte order).
    pub fn guid(&self) -> u64 {
        // SAFETY: `dev` is valid while the list is.
        u64::from_be(unsafe { sys::ibv_get_device_guid(self.dev) })
    }

    /// Opens the device.
    pub fn open(&self) -> Result<Context> {
        // SAFETY: `dev` is valid while the list is; the context is closed in `Drop`.
        let raw = unsafe { sys::ibv_open_device(self.dev) };
        let ctx = NonNull::new(raw).ok_or_else(|| Error::Verb { verb: "ibv_open_device", source: io::Error::last_os_error() })?;
        Ok(Context { inner: Arc::new(ContextInner { ctx, name: self.name() }) })
    }
}

impl fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("name", &self.name()).field("guid", &format_args!("{:016x}", self.guid())).finish()
    }
}

/// An open device (`ibv_context`). Clones share it.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<sys::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread concurrently (the verbs API
// is thread safe); the pointer is only freed in `Drop`, when no clone is left.
unsafe impl Send for ContextInner {}
// SAFETY: as for `Send`: every verb on a context is thread safe.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone, and every child (PD, CQ) holds a clone,
        // so nothing uses the context any more.
        unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
    }
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Self> {
        DeviceList::new()?.find(name)?.open()
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// Attributes of port `port` (ports count from 1).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: all-zero is a valid `ibv_port_attr` (plain integers).
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer of the size the
        // provider is told.
        let rc = unsafe { sys::___ibv_query_port(self.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(Error::Verb { verb: "ibv_query_port", source: io::Error::from_raw_os_error(rc) });
        }
        Ok(PortAttr {
            state: PortState::from_raw(attr.state),
            active_mtu: Mtu::from_raw(attr.active_mtu),
            max_mtu: Mtu::from_raw(attr.max_mtu),
            lid: attr.lid,
            gid_table_len: attr.gid_tbl_len,
            link_layer_ethernet: attr.link_layer == LINK_LAYER_ETHERNET,
        })
    }

    /// The GID at `index` of port `port`'s GID table.
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid> {
        // SAFETY: all-zero is a valid `ibv_gid` (16 bytes).
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        let rc = unsafe { sys::ibv_query_gid(self.as_ptr(), port, i32::from(index), &mut gid) };
        if rc != 0 {
            return Err(Error::Verb { verb: "ibv_query_gid", source: io::Error::last_os_error() });
        }
        // SAFETY: every bit pattern is a valid `[u8; 16]`.
        Ok(Gid(unsafe { gid.raw }))
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("name", &self.inner.name).finish_non_exhaustive()
    }
}

/// The attributes of a port that connecting a queue pair needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttr {
    /// The logical port state.
    pub state: PortState,
    /// The MTU in use; a queue pair's path MTU.
    pub active_mtu: Mtu,
    /// The largest MTU the port supports.
    pub max_mtu: Mtu,
    /// The port's LID (0 on RoCE, where GIDs address ports).
    pub lid: u16,
    /// Entries in the GID table.
    pub gid_table_len: i32,
    /// RoCE (Ethernet) rather than InfiniBand.
    pub link_layer_ethernet: bool,
}

/// A port's logical state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortState {
    /// Not connected to anything.
    Down,
    /// Link up, not yet configured by the subnet manager.
    Init,
    /// Configured, not yet forwarding.
    Armed,
    /// Usable.
    Active,
    /// Another state, as libibverbs numbers it.
    Other(u32),
}

impl PortState {
    fn from_raw(raw: sys::ibv_port_state::Type) -> Self {
        use sys::ibv_port_state as s;
        match raw {
            s::IBV_PORT_DOWN => Self::Down,
            s::IBV_PORT_INIT => Self::Init,
            s::IBV_PORT_ARMED => Self::Armed,
            s::IBV_PORT_ACTIVE => Self::Active,
            other => Self::Other(other),
        }
    }
}

/// A path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mtu(sys::ibv_mtu::Type);

impl Mtu {
    /// 1024 bytes.
    pub const MTU_1024: Mtu = Mtu(sys::ibv_mtu::IBV_MTU_1024);
    /// 4096 bytes.
    pub const MTU_4096: Mtu = Mtu(sys::ibv_mtu::IBV_MTU_4096);

    fn from_raw(raw: sys::ibv_mtu::Type) -> Self {
        Mtu(raw)
    }

    pub(crate) fn raw(self) -> sys::ibv_mtu::Type {
        self.0
    }

    /// The MTU in bytes (256 to 4096).
    pub fn bytes(self) -> u32 {
        128 << self.0
    }

    /// The MTU of `bytes` (256, 512, 1024, 2048 or 4096), or `None`.
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        (1..=5).map(|raw| Mtu(raw as sys::ibv_mtu::Type)).find(|m| m.bytes() == bytes)
    }
}

/// A 128-bit global identifier: a port's address on RoCE.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`), the form RoCEv2 uses
    /// for a netdev's IPv4 address.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        std::net::Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// Whether the GID is all zeros (an unused table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({})", std::net::Ipv6Addr::from(self.0))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&std::net::Ipv6Addr::from(self.0), f)
    }
}
