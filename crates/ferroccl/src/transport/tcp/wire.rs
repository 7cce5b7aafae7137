//! tcp's frames: a 40-byte header (kind, immediate, length, registration key, address)
//! followed by the payload.

pub(super) const HDR: usize = 40;
pub(super) const K_MSG: u8 = 1;
pub(super) const K_WRITE: u8 = 2;
pub(super) const K_BYE: u8 = 3;
/// A strided write: `len` bytes in rows of the u32 at header byte 32, landing the u32 at
/// byte 36 apart from `addr` on; every row's immediate is reported (`row_imm`).
pub(super) const K_WRITE_ROWS: u8 = 4;
/// The first piece of a striped write (on lane 0): lands like `K_WRITE`; the u32 at byte 32
/// numbers the write, the u32 at byte 36 says how many pieces (`K_STRIPE`) went on the
/// other lanes. Its immediate is reported, and lane 0 reads on, once they have all landed.
pub(super) const K_STRIPED: u8 = 5;
/// Another piece of a striped write (lanes 1 and up, the only kind they carry besides
/// `K_BYE`): lands like `K_WRITE`, numbered by the u32 at byte 32, no immediate of its own.
pub(super) const K_STRIPE: u8 = 6;
/// Largest two-sided message on tcp.
pub(super) const MAX_MSG: usize = 4 << 20;
/// Rows shorter than this are gathered into batches of up to this many bytes before they
/// go into the socket (one system call per batch, not per row).
pub(super) const GATHER_MAX: usize = 256 << 10;

/// The little-endian u32 at `h[at..at + 4]`.
pub(super) fn u32_at(h: &[u8; HDR], at: usize) -> u32 {
    u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]])
}

/// The little-endian u64 at `h[at..at + 8]`.
pub(super) fn u64_at(h: &[u8; HDR], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&h[at..at + 8]);
    u64::from_le_bytes(a)
}

pub(super) fn header(kind: u8, imm: u32, len: u64, key: u64, addr: u64) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0] = kind;
    h[4..8].copy_from_slice(&imm.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h[16..24].copy_from_slice(&key.to_le_bytes());
    h[24..32].copy_from_slice(&addr.to_le_bytes());
    h
}

/// The body length of the frame with header `h`, checked; `Err` says what is wrong with it.
pub(super) fn body_len(h: &[u8; HDR]) -> std::result::Result<usize, String> {
    let len = u64_at(h, 8);
    match h[0] {
        K_MSG if len > MAX_MSG as u64 => Err(format!("sent a {len}-byte message, over the {MAX_MSG}-byte limit")),
        K_MSG | K_WRITE | K_STRIPED | K_STRIPE => usize::try_from(len).map_err(|_| format!("sent a write of {len} bytes")),
        K_WRITE_ROWS => {
            let (row, stride) = (u64::from(u32_at(h, 32)), u64::from(u32_at(h, 36)));
            match len.checked_div(row) {
                Some(n) if len.is_multiple_of(row) && n <= u64::from(u32::MAX) && (n <= 1 || stride >= row) => {
                    usize::try_from(len).map_err(|_| format!("sent a strided write of {len} bytes"))
                }
                _ => Err(format!("sent a strided write of {len} bytes in rows of {row}, {stride} apart")),
            }
        }
        K_BYE => Ok(0),
        k => Err(format!("sent an unknown TCP frame kind {k}")),
    }
}
