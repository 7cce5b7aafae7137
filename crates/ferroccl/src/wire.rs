//! A tiny bounds-checked binary codec (little endian) for store frames, mesh handshakes and
//! endpoint descriptors. Reading past the end or a bad length is an error, never a panic.
//! Also [`RemoteBuf`], the remote side of a one-sided write: the protocols advertise it,
//! the transports write into it, so it lives below both.

/// What a peer needs to write into one of our registered regions: the verbs (addr, len,
/// rkey) triple, advertised in a clear-to-send (`crate::proto`) and the target of every
/// one-sided write (`crate::transport`). `key` names the registration in the owning
/// process (for a verbs peer it is the memory region's rkey).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteBuf {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) key: u64,
}

/// Appends values to a byte vector.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    pub(crate) fn new() -> Self {
        Writer { buf: Vec::new() }
    }
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A u32 length followed by the bytes.
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(u32::try_from(v.len()).expect("wire field over 4 GiB"));
        self.buf.extend_from_slice(v);
        self
    }
    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    pub(crate) fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads values from a byte slice; every read checks the remaining length.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// What went wrong while decoding (turned into `Error::Protocol` by the caller, who knows
/// the peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub(crate) type DResult<T> = std::result::Result<T, DecodeError>;

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, what: &str) -> DResult<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            DecodeError(format!("truncated {what}: need {n} bytes at offset {}, have {}", self.pos, self.buf.len() - self.pos))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> DResult<u8> {
        Ok(self.take(1, "u8")?[0])
    }
    pub(crate) fn u32(&mut self) -> DResult<u32> {
        let b = self.take(4, "u32")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(crate) fn u64(&mut self) -> DResult<u64> {
        let b = self.take(8, "u64")?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn i64(&mut self) -> DResult<i64> {
        Ok(self.u64()? as i64)
    }
    pub(crate) fn bytes(&mut self) -> DResult<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n, "byte string")
    }
    pub(crate) fn str(&mut self) -> DResult<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| DecodeError("string is not UTF-8".into()))
    }
    pub(crate) fn raw(&mut self, n: usize) -> DResult<&'a [u8]> {
        self.take(n, "raw bytes")
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Errors if bytes are left over (a frame longer than its fields).
    pub(crate) fn end(&self) -> DResult<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(DecodeError(format!("{} trailing bytes", self.remaining())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let mut w = Writer::new();
        w.u8(7).u32(0xdead_beef).u64(u64::MAX).i64(-5).str("héllo").bytes(&[1, 2, 3]);
        let b = w.finish();
        let mut r = Reader::new(&b);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.i64().unwrap(), -5);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.bytes().unwrap(), &[1, 2, 3]);
        r.end().unwrap();
    }

    proptest! {
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut r = Reader::new(&data);
            let _ = r.u8().and_then(|_| r.str()).and_then(|_| r.bytes()).and_then(|_| r.u64());
        }
    }
}
