//! The ranks' output: each line of each rank's stdout and stderr, prefixed with its rank.

use std::io::{self, BufRead, BufReader, Read, Write};

/// Longest line passed on whole; longer ones are split.
const MAX_LINE: usize = 1 << 20;

/// Copies one output stream of one rank to the runner's stream, a line at a time.
pub(crate) fn pump(src: impl Read, rank: usize, to_stderr: bool, prefix: bool) {
    let mut reader = BufReader::with_capacity(64 << 10, src);
    let tag = format!("[{rank}] ");
    let mut line: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    let emit = |line: &[u8], out: &mut Vec<u8>| {
        out.clear();
        if prefix {
            out.extend_from_slice(tag.as_bytes());
            let body = line.strip_suffix(b"\n").unwrap_or(line);
            out.extend_from_slice(String::from_utf8_lossy(body).as_bytes());
            out.push(b'\n');
        } else {
            out.extend_from_slice(line);
        }
        // Errors (a closed stdout) are ignored: the rank's output is still drained, so it
        // never blocks on a full pipe.
        if to_stderr {
            let _ = io::stderr().lock().write_all(out);
        } else {
            let mut so = io::stdout().lock();
            let _ = so.write_all(out).and_then(|()| so.flush());
        }
    };
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if buf.is_empty() {
            break;
        }
        let (take, complete) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if complete || line.len() >= MAX_LINE {
            emit(&line, &mut out);
            line.clear();
        }
    }
    if !line.is_empty() {
        emit(&line, &mut out);
    }
}
