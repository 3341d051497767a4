//! The BPE vocabularies (o200k_base, cl100k_base), embedded in the binary and decoded on first
//! use. Their serialized form is 32 and 15 MB. Decoding it from the embedded bytes would page
//! them in, and they would stay counted in the process's memory (RSS) for its whole life,
//! beside the decoded vocabulary. So the same bytes are decoded as they are read from the
//! binary's file instead (`/proc/self/exe`, at the offset where they are mapped), 64 KiB at a
//! time, each chunk checked against the hash the build wrote before the decoder sees it. Where
//! that cannot be done (no `/proc`), or a chunk differs, the embedded bytes are decoded as they
//! are.

use std::fs::File;
use std::hash::{DefaultHasher, Hasher};
use std::io::{Read, Seek, SeekFrom, Take};
use std::sync::LazyLock;

use bpe::byte_pair_encoding::BytePairEncoding;

use super::Encoding;

/// An embedded vocabulary, and the size and hashes of its chunks, as `build.rs` wrote them.
struct Embedded {
    bytes: &'static [u8],
    chunks: (usize, &'static [u64]),
}

static O200K_BASE: Embedded = Embedded {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/o200k_base.dict")),
    chunks: include!(concat!(env!("OUT_DIR"), "/o200k_base.chunks")),
};

static CL100K_BASE: Embedded = Embedded {
    bytes: include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_base.dict")),
    chunks: include!(concat!(env!("OUT_DIR"), "/cl100k_base.chunks")),
};

static O200K: LazyLock<BytePairEncoding> = LazyLock::new(|| decode(&O200K_BASE));
static CL100K: LazyLock<BytePairEncoding> = LazyLock::new(|| decode(&CL100K_BASE));

/// The vocabulary of `encoding`, decoded on first use.
pub fn of(encoding: Encoding) -> &'static BytePairEncoding {
    match encoding {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
    }
}

fn decode(embedded: &'static Embedded) -> BytePairEncoding {
    decode_from_executable(embedded).unwrap_or_else(|| {
        // The build wrote these bytes from a decoded vocabulary: they decode.
        rmp_serde::from_slice(embedded.bytes)
            .unwrap_or_else(|e| unreachable!("an embedded vocabulary does not decode: {e}"))
    })
}

/// `embedded` decoded from the executable's file, not from its mapped pages; `None` when the
/// file cannot be read there, or its bytes are not the embedded ones.
fn decode_from_executable(embedded: &'static Embedded) -> Option<BytePairEncoding> {
    let mut read = VerifiedChunks::new(executable_copy(embedded.bytes)?, embedded.chunks);
    let decoded = rmp_serde::from_read(&mut read).ok()?;
    read.all_read().then_some(decoded)
}

/// A reader of `embedded`'s bytes in the executable's file.
fn executable_copy(embedded: &'static [u8]) -> Option<Take<File>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let offset = file_offset(&maps, embedded.as_ptr() as usize)?;
    let mut file = File::open("/proc/self/exe").ok()?;
    file.seek(SeekFrom::Start(offset)).ok()?;
    Some(file.take(embedded.len() as u64))
}

/// Where the byte at `address` comes from in the file mapped there, per `/proc/self/maps`
/// (`start-end perms offset dev inode path`).
fn file_offset(maps: &str, address: usize) -> Option<u64> {
    maps.lines().find_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&address) {
            return None;
        }
        let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
        let inode = fields.nth(1)?;
        // An anonymous mapping holds no file's bytes.
        (inode != "0").then_some(offset + (address - start) as u64)
    })
}

/// A reader that gives out the bytes of `inner` one chunk at a time, each only once its hash is
/// the expected one: a chunk that differs (or is missing) is a read error.
struct VerifiedChunks<R> {
    inner: R,
    hashes: &'static [u64],
    /// The chunk being given out, and how much of it was.
    chunk: Vec<u8>,
    given: usize,
    /// Chunks checked so far.
    checked: usize,
}

impl<R: Read> VerifiedChunks<R> {
    fn new(inner: R, (size, hashes): (usize, &'static [u64])) -> Self {
        VerifiedChunks {
            inner,
            hashes,
            chunk: Vec::with_capacity(size),
            given: 0,
            checked: 0,
        }
    }

    /// Whether every chunk was read and checked, and nothing follows them.
    fn all_read(&mut self) -> bool {
        let mut rest = [0u8; 1];
        self.checked == self.hashes.len()
            && self.given == self.chunk.len()
            && matches!(self.inner.read(&mut rest), Ok(0))
    }

    fn next_chunk(&mut self) -> std::io::Result<()> {
        let Some(&expected) = self.hashes.get(self.checked) else {
            self.chunk.clear();
            self.given = 0;
            return Ok(());
        };
        let size = self.chunk.capacity();
        self.chunk.clear();
        (&mut self.inner)
            .take(size as u64)
            .read_to_end(&mut self.chunk)?;
        let mut hasher = DefaultHasher::new();
        hasher.write(&self.chunk);
        if hasher.finish() != expected {
            return Err(std::io::Error::other(
                "a vocabulary chunk differs from the build's",
            ));
        }
        self.checked += 1;
        self.given = 0;
        Ok(())
    }
}

impl<R: Read> Read for VerifiedChunks<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.given == self.chunk.len() {
            self.next_chunk()?;
        }
        let n = buf.len().min(self.chunk.len() - self.given);
        buf[..n].copy_from_slice(&self.chunk[self.given..self.given + n]);
        self.given += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(bytes: &[u8]) -> u64 {
        let mut hasher = DefaultHasher::new();
        hasher.write(bytes);
        hasher.finish()
    }

    fn chunks_of(bytes: &[u8], size: usize) -> (usize, &'static [u64]) {
        let hashes: Vec<u64> = bytes.chunks(size).map(hash).collect();
        (size, Box::leak(hashes.into_boxed_slice()))
    }

    #[test]
    fn the_bytes_read_from_the_file_are_the_embedded_ones() {
        for embedded in [&O200K_BASE, &CL100K_BASE] {
            let copy = executable_copy(embedded.bytes).expect("this test runs on Linux");
            let mut reader = VerifiedChunks::new(copy, embedded.chunks);
            let mut read = Vec::new();
            reader.read_to_end(&mut read).unwrap();
            assert!(read == embedded.bytes);
            assert!(reader.all_read());
            assert!(decode_from_executable(embedded).is_some());
        }
    }

    #[test]
    fn a_chunk_is_given_out_only_once_it_checks() {
        let chunks = chunks_of(b"abcdef", 4);
        let mut whole = Vec::new();
        let mut reader = VerifiedChunks::new(&b"abcdef"[..], chunks);
        reader.read_to_end(&mut whole).unwrap();
        assert_eq!(
            (whole.as_slice(), reader.all_read()),
            (&b"abcdef"[..], true)
        );

        let mut reader = VerifiedChunks::new(&b"abcdXf"[..], chunks);
        let mut first = [0u8; 4];
        reader.read_exact(&mut first).unwrap();
        assert!(
            reader.read(&mut [0u8; 4]).is_err(),
            "the altered chunk is never given out"
        );

        let mut longer = VerifiedChunks::new(&b"abcdefgh!"[..], chunks_of(b"abcdefgh", 4));
        longer.read_to_end(&mut Vec::new()).unwrap();
        assert!(!longer.all_read(), "bytes past the last chunk");
        let mut shorter = VerifiedChunks::new(&b"abcd"[..], chunks);
        assert!(shorter.read_to_end(&mut Vec::new()).is_err() || !shorter.all_read());

        // A vocabulary whose file bytes differ from the build's is decoded from its pages.
        let (size, hashes) = CL100K_BASE.chunks;
        let mut altered = hashes.to_vec();
        altered[1] ^= 1;
        let altered: &'static Embedded = Box::leak(Box::new(Embedded {
            bytes: CL100K_BASE.bytes,
            chunks: (size, Box::leak(altered.into_boxed_slice())),
        }));
        assert!(decode_from_executable(altered).is_none());
        assert_eq!(
            decode(altered).count(b"hello world"),
            bpe_openai::cl100k_base().bpe.count(b"hello world")
        );
    }

    #[test]
    fn an_address_is_found_in_its_mapping() {
        let maps = "55d0c9a00000-55d0c9a29000 r--p 00000000 08:01 1234 /bin/ctxproxy\n\
            55d0c9a29000-55d0c9b00000 r-xp 00029000 08:01 1234 /bin/ctxproxy\n\
            7f0000000000-7f0000001000 rw-p 00000000 00:00 0\n";
        assert_eq!(file_offset(maps, 0x55d0c9a00010), Some(0x10));
        assert_eq!(file_offset(maps, 0x55d0c9a29100), Some(0x29100));
        assert_eq!(file_offset(maps, 0x7f0000000010), None, "anonymous");
        assert_eq!(file_offset(maps, 0x1000), None, "not mapped");
    }

    #[test]
    fn the_decoded_vocabularies_are_the_tokenizer_crates() {
        let text = "Résumé: ünïcödé 🚀 and ASCII, 12345 tokens.\n\n  indented   ";
        assert_eq!(
            of(Encoding::O200kBase).encode_via_backtracking(text.as_bytes()),
            bpe_openai::o200k_base()
                .bpe
                .encode_via_backtracking(text.as_bytes())
        );
        assert_eq!(
            of(Encoding::Cl100kBase).count(text.as_bytes()),
            bpe_openai::cl100k_base().bpe.count(text.as_bytes())
        );
    }
}
