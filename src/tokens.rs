//! Token counting with the real OpenAI BPE vocabularies (o200k_base, cl100k_base), the way
//! OpenAI bills a chat request: per-message overhead, role, name, content parts, tool calls,
//! and tool definitions.
//!
//! Per-message counts are cached by a hash of what is counted, so a long history is not
//! re-tokenized on every turn. The cache is a memo: it never changes a result.

mod pretokenize;
mod vocabulary;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bpe::byte_pair_encoding::BytePairEncoding;

use crate::bounded::SharedLru;
use serde::{Deserialize, Serialize};

use crate::openai::{ChatRequest, Content, Message, Role, SharedText, Tool, hash_json};

/// Every message is framed as `<|start|>{role}<|message|>{content}<|end|>`.
const TOKENS_PER_MESSAGE: usize = 3;
/// A `name` field costs one token beyond its text.
const TOKENS_PER_NAME: usize = 1;
/// Every reply is primed with `<|start|>assistant<|message|>`.
const REPLY_PRIMING: usize = 3;
/// An image part, at low detail (OpenAI's base cost); `detail: high` counts a 512 px tile more.
const IMAGE_LOW_DETAIL: usize = 85;
const IMAGE_HIGH_DETAIL: usize = 85 + 170;
/// Framing of each tool definition and of the tool list (OpenAI's published approximation).
const TOKENS_PER_TOOL: usize = 7;
const TOOLS_FRAMING: usize = 12;
/// Bytes of one encoding's count cache when none is configured (`[memory]` sets it).
const CACHE_BYTES: usize = 8 * 1024 * 1024;
/// Texts at least this long have their counts cached (shorter ones are cheaper to count).
const LONG_TEXT_BYTES: usize = 512;
/// A long text is counted in parts of at least this many bytes (`pretokenize::parts`).
const PART_BYTES: usize = 2048;
/// `fits` counts an uncached part a chunk of about this many bytes at a time.
const FITS_CHUNK_BYTES: usize = 512;
/// An instruction text is counted in smaller parts: the summary section the window stage
/// writes in it changes by a few lines from pass to pass and point to point.
const INSTRUCTION_PART_BYTES: usize = 256;
/// Seeds that keep message keys and text keys apart in the one cache.
const MESSAGE_SEED: u64 = 0x6d65_7373_6167_6573;
const TEXT_SEED: u64 = 0x7465_7874_7465_7874;
const TOOL_SEED: u64 = 0x746f_6f6c_746f_6f6c;
const BLOCK_SEED: u64 = 0x626c_6f63_6b73_0001;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    O200kBase,
    Cl100kBase,
}

impl Encoding {
    /// o200k_base for gpt-4o, gpt-4.1, o-series, gpt-5 and unknown models; cl100k_base for
    /// gpt-4 (non-o), gpt-3.5 and the ada/3-series embeddings.
    pub fn for_model(model: &str) -> Encoding {
        let model = model
            .rsplit('/')
            .next()
            .unwrap_or(model)
            .to_ascii_lowercase();
        let cl100k = model == "gpt-4"
            || [
                "gpt-4-",
                "gpt-3.5",
                "gpt-35",
                "text-embedding-3",
                "text-embedding-ada",
            ]
            .iter()
            .any(|prefix| model.starts_with(prefix));
        if cl100k {
            Encoding::Cl100kBase
        } else {
            Encoding::O200kBase
        }
    }

    fn vocabulary(self) -> &'static BytePairEncoding {
        vocabulary::of(self)
    }

    /// The token ids of `text` (every character as text, no special tokens).
    pub fn encode(self, text: &str) -> Vec<u32> {
        let vocabulary = self.vocabulary();
        let mut tokens = Vec::new();
        pretokenize::for_each_piece(self, text, |piece| {
            tokens.extend(vocabulary.encode_via_backtracking(piece));
        });
        tokens
    }

    /// Tokens of `text`: the tokenizer's pre-tokenization (searched with this thread's cache,
    /// `pretokenize`), then each piece counted once per thread (words repeat, and counting a
    /// piece allocates an encoder). Same result as `Tokenizer::count`. No count of the text
    /// itself is read or kept: the proxy counts through a `TokenCounter`; this is public for
    /// the benchmark of counting a text never seen.
    pub fn count(self, text: &str) -> usize {
        let vocabulary = self.vocabulary();
        PIECE_COUNTS.with_borrow_mut(|cache| {
            let cache = &mut cache.0[self as usize];
            if cache.len() >= PIECE_CACHE_CAPACITY {
                PIECE_CACHE_BYTES.fetch_sub(cache.bytes(), Ordering::Relaxed);
                *cache = PieceCache::default();
            }
            let mut total = 0;
            pretokenize::for_each_piece(self, text, |piece| {
                total += match piece.len() {
                    1 => 1, // every byte is a token
                    2 => cache.pair(piece[0], piece[1], || vocabulary.count(piece)),
                    n if n > PIECE_CACHE_MAX_BYTES => vocabulary.count(piece),
                    _ => cache.count(piece, || vocabulary.count(piece) as u32),
                };
            });
            total
        })
    }
}

/// The tokenizer crate's own tokenizer: what the counts here are tested against.
#[cfg(test)]
fn reference(encoding: Encoding) -> &'static bpe_openai::Tokenizer {
    match encoding {
        Encoding::O200kBase => bpe_openai::o200k_base(),
        Encoding::Cl100kBase => bpe_openai::cl100k_base(),
    }
}

/// Pieces longer than this are counted without the cache (they rarely repeat).
const PIECE_CACHE_MAX_BYTES: usize = 24;
/// Entries per thread and encoding before the piece cache is cleared (~3 MB).
const PIECE_CACHE_CAPACITY: usize = 50_000;
/// Bytes held by the piece caches and the recent counts of every thread.
static PIECE_CACHE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes held by the piece caches of every thread (bounded: `PIECE_CACHE_CAPACITY` pieces per
/// thread and encoding, each at most `PIECE_CACHE_MAX_BYTES` long), and by their recent counts
/// (`RECENT_SLOTS` each).
pub fn piece_cache_bytes_total() -> usize {
    PIECE_CACHE_BYTES.load(Ordering::Relaxed)
}

/// Token counts of pieces, one encoding's. A piece of at most `PACKED_MAX_BYTES` (most pieces:
/// words, numbers, JSON punctuation) is keyed by its bytes read as two numbers (`packed`), which
/// hash and compare without reading the text again; a longer one by its bytes.
#[derive(Default)]
struct PieceCache {
    packed: HashMap<(u64, u64), u32, foldhash::fast::RandomState>,
    long: HashMap<Box<[u8]>, u32, foldhash::fast::RandomState>,
    /// The counts of two-byte pieces (`":`, `id`, `12`: many of JSON's pieces), by their bytes;
    /// 0 for one not counted yet. Made on the first such piece.
    pairs: Option<Box<[u8]>>,
}

/// Two-byte pieces: every pair of bytes.
const PAIRS: usize = 1 << 16;

/// The longest piece kept packed: its bytes and its length fill two `u64`s.
const PACKED_MAX_BYTES: usize = 15;
/// What an entry costs: its slot in the table (key and count), and a long piece's boxed text.
const PACKED_ENTRY_BYTES: usize = std::mem::size_of::<((u64, u64), u32)>() + 16;
const LONG_ENTRY_BYTES: usize = std::mem::size_of::<(Box<[u8]>, u32)>() + 16;

impl PieceCache {
    fn len(&self) -> usize {
        self.packed.len() + self.long.len()
    }

    fn bytes(&self) -> usize {
        self.pairs.as_ref().map_or(0, |_| PAIRS)
            + self.packed.len() * PACKED_ENTRY_BYTES
            + (self.long.keys())
                .map(|k| LONG_ENTRY_BYTES + k.len())
                .sum::<usize>()
    }

    /// The count of the two-byte piece `first second` (1 or 2), from `count` the first time.
    fn pair(&mut self, first: u8, second: u8, count: impl FnOnce() -> usize) -> usize {
        let pairs = self.pairs.get_or_insert_with(|| {
            PIECE_CACHE_BYTES.fetch_add(PAIRS, Ordering::Relaxed);
            vec![0; PAIRS].into_boxed_slice()
        });
        let slot = &mut pairs[usize::from(first) << 8 | usize::from(second)];
        if *slot == 0 {
            // A piece of two bytes is one token or two.
            *slot = count() as u8;
        }
        usize::from(*slot)
    }

    /// The count of `piece`, from `count` the first time.
    fn count(&mut self, piece: &[u8], count: impl FnOnce() -> u32) -> usize {
        if let Some(key) = packed(piece) {
            if let Some(&count) = self.packed.get(&key) {
                return count as usize;
            }
            let count = count();
            self.packed.insert(key, count);
            PIECE_CACHE_BYTES.fetch_add(PACKED_ENTRY_BYTES, Ordering::Relaxed);
            return count as usize;
        }
        if let Some(&count) = self.long.get(piece) {
            return count as usize;
        }
        let count = count();
        self.long.insert(piece.into(), count);
        PIECE_CACHE_BYTES.fetch_add(LONG_ENTRY_BYTES + piece.len(), Ordering::Relaxed);
        count as usize
    }
}

/// A piece of at most `PACKED_MAX_BYTES` as two numbers, read with a few loads that may
/// overlap: its first bytes, then what is left of it and, in the last byte, its length. For a
/// given length the loads cover every byte, so no two pieces share a key.
fn packed(piece: &[u8]) -> Option<(u64, u64)> {
    let n = piece.len();
    let u32_at = |at: usize| {
        u64::from(u32::from_le_bytes([
            piece[at],
            piece[at + 1],
            piece[at + 2],
            piece[at + 3],
        ]))
    };
    let u64_at = |at: usize| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&piece[at..at + 8]);
        u64::from_le_bytes(bytes)
    };
    let first = match n {
        0 => 0,
        1..=3 => u64::from(piece[0]) | u64::from(piece[n / 2]) << 8 | u64::from(piece[n - 1]) << 16,
        4..=8 => u32_at(0) | u32_at(n - 4) << 32,
        9..=PACKED_MAX_BYTES => u64_at(0),
        _ => return None,
    };
    // Bytes 8 to `n` (none when `n <= 8`), at the bottom of the last eight.
    let rest = if n > 8 {
        u64_at(n - 8) >> (8 * (16 - n))
    } else {
        0
    };
    Some((first, rest | (n as u64) << 56))
}

/// One thread's piece caches, one per encoding; their bytes leave the total with the thread.
#[derive(Default)]
struct PieceCaches([PieceCache; 2]);

impl Drop for PieceCaches {
    fn drop(&mut self) {
        let bytes = self.0.iter().map(PieceCache::bytes).sum();
        PIECE_CACHE_BYTES.fetch_sub(bytes, Ordering::Relaxed);
    }
}

thread_local! {
    /// Token counts of pre-tokenized pieces, one map per encoding.
    static PIECE_COUNTS: std::cell::RefCell<PieceCaches> = Default::default();
}

/// Slots of a thread's recent counts: a count is looked up at every stage and point of a
/// request, and the shared cache takes a lock per lookup.
const RECENT_SLOTS: usize = 4096;

thread_local! {
    /// Recent counts by key, one slot per key's low bits: `(key, count + 1)`, 0 for an empty
    /// slot. A key digests what is counted (its encoding among it), so a count read here is the
    /// count the shared cache holds or would make.
    static RECENT_COUNTS: std::cell::RefCell<RecentCounts> = Default::default();
}

/// A thread's recent counts, made on first use; their bytes are counted with the piece caches'.
#[derive(Default)]
struct RecentCounts(Option<Box<[(u64, u32)]>>);

impl Drop for RecentCounts {
    fn drop(&mut self) {
        if self.0.is_some() {
            PIECE_CACHE_BYTES.fetch_sub(RECENT_BYTES, Ordering::Relaxed);
        }
    }
}

const RECENT_BYTES: usize = RECENT_SLOTS * std::mem::size_of::<(u64, u32)>();

fn recent_slot(key: u64) -> usize {
    (key as usize) & (RECENT_SLOTS - 1)
}

fn recent_count(key: u64) -> Option<usize> {
    RECENT_COUNTS.with_borrow(|recent| {
        let (slot_key, count) = recent.0.as_ref()?[recent_slot(key)];
        (slot_key == key && count > 0).then(|| count as usize - 1)
    })
}

fn keep_recent_count(key: u64, count: usize) {
    let Ok(count) = u32::try_from(count + 1) else {
        return;
    };
    RECENT_COUNTS.with_borrow_mut(|recent| {
        let slots = recent.0.get_or_insert_with(|| {
            PIECE_CACHE_BYTES.fetch_add(RECENT_BYTES, Ordering::Relaxed);
            vec![(0, 0); RECENT_SLOTS].into_boxed_slice()
        });
        slots[recent_slot(key)] = (key, count);
    });
}

/// One counter per encoding, shared by all requests.
pub struct Tokenizers {
    o200k: TokenCounter,
    cl100k: TokenCounter,
}

impl Default for Tokenizers {
    fn default() -> Self {
        Tokenizers::new(2 * CACHE_BYTES, None)
    }
}

impl Tokenizers {
    /// Counters whose count caches hold `max_bytes` together, dropping entries unused for
    /// `idle`.
    pub fn new(max_bytes: usize, idle: Option<Duration>) -> Tokenizers {
        Tokenizers {
            o200k: TokenCounter::bounded(Encoding::O200kBase, max_bytes / 2, idle),
            cl100k: TokenCounter::bounded(Encoding::Cl100kBase, max_bytes / 2, idle),
        }
    }

    /// Drops the counts no request used within the idle time.
    pub fn sweep(&self, now: Instant) {
        self.o200k.cache.sweep(now);
        self.cl100k.cache.sweep(now);
    }

    /// Bytes held by the count caches.
    pub fn bytes(&self) -> usize {
        self.o200k.cache.bytes() + self.cl100k.cache.bytes()
    }

    /// Loads the vocabularies of `encodings` now (~60 ms for o200k_base) instead of on the
    /// first request that needs one, and compiles their split patterns (what text that is not
    /// ASCII is split with: ~5 ms the first request with such text would otherwise wait); the
    /// others load when a request first needs them.
    pub fn warm_up(&self, encodings: &[Encoding]) {
        for encoding in encodings {
            self.for_encoding(*encoding).text("warm up, café");
        }
    }

    /// The counter for a model, unless the route forces an encoding.
    pub fn for_model(&self, model: &str, forced: Option<Encoding>) -> &TokenCounter {
        self.for_encoding(forced.unwrap_or_else(|| Encoding::for_model(model)))
    }

    pub fn for_encoding(&self, encoding: Encoding) -> &TokenCounter {
        match encoding {
            Encoding::O200kBase => &self.o200k,
            Encoding::Cl100kBase => &self.cl100k,
        }
    }
}

/// Counts tokens for one encoding, with the per-message cache.
pub struct TokenCounter {
    encoding: Encoding,
    cache: SharedLru<u64, usize>,
}

/// The parts of at least `part_bytes` that a long text is counted and cached in
/// (`pretokenize::parts`), or the whole text when it is shorter than two.
fn cached_parts(text: &str, part_bytes: usize) -> impl Iterator<Item = &str> {
    let whole = text.len() < 2 * part_bytes;
    let long = (!whole).then(|| pretokenize::parts(text, part_bytes));
    whole
        .then_some(text)
        .into_iter()
        .chain(long.into_iter().flatten())
}

impl TokenCounter {
    pub fn new(encoding: Encoding) -> Self {
        TokenCounter::bounded(encoding, CACHE_BYTES, None)
    }

    fn bounded(encoding: Encoding, max_bytes: usize, idle: Option<Duration>) -> Self {
        TokenCounter {
            encoding,
            cache: SharedLru::new(max_bytes, idle),
        }
    }

    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    pub fn text(&self, text: &str) -> usize {
        if text.is_empty() {
            return 0;
        }
        if text.len() < LONG_TEXT_BYTES {
            return self.encoding.count(text);
        }
        self.text_recurring(text)
    }

    /// `text`, cached whatever its length: for texts that recur from request to request (a
    /// conversation's ledger lines and stubs). A long text is counted part by part, each part
    /// cached: a system message whose sections change keeps the counts of the instructions
    /// before them.
    pub fn text_recurring(&self, text: &str) -> usize {
        self.text_in_parts(text, PART_BYTES)
    }

    /// `text`, a system or developer message's (an application's instructions, the proxy's
    /// summary section), counted in parts of a few lines, each cached: the section's ledger
    /// grows by lines, and its other parts are the same from pass to pass.
    pub fn instructions(&self, text: &str) -> usize {
        if text.len() < LONG_TEXT_BYTES {
            return self.text(text);
        }
        self.text_in_parts(text, INSTRUCTION_PART_BYTES)
    }

    /// `text` counted in parts of at least `part_bytes` (one part when it is shorter than two),
    /// each part cached.
    fn text_in_parts(&self, text: &str, part_bytes: usize) -> usize {
        if text.is_empty() {
            return 0;
        }
        cached_parts(text, part_bytes)
            .map(|part| self.text_cached(part))
            .sum()
    }

    fn text_cached(&self, text: &str) -> usize {
        self.cached(self.text_key(text), || self.encoding.count(text))
    }

    fn text_key(&self, text: &str) -> u64 {
        let mut hasher = foldhash::quality::FixedState::with_seed(TEXT_SEED).build_hasher();
        self.encoding.hash(&mut hasher);
        text.hash(&mut hasher);
        hasher.finish()
    }

    /// Whether `text` counts at most `max_tokens` (`text(text) <= max_tokens`), counted only
    /// until it is known: a compaction or a stub tried before a tighter one is often many
    /// times over, and is not counted to its end. The parts `text` caches are read from the
    /// cache, and kept there when counted whole.
    pub fn fits(&self, text: &str, max_tokens: usize) -> bool {
        if text.len() < LONG_TEXT_BYTES {
            return self.text(text) <= max_tokens;
        }
        let mut left = max_tokens;
        let part_fits = |part: &str| {
            let key = self.text_key(part);
            let tokens = match self.cache.get(&key) {
                Some(tokens) => tokens,
                None => {
                    let mut tokens = 0;
                    for chunk in pretokenize::chunks_at_spaces(part, FITS_CHUNK_BYTES) {
                        tokens += self.encoding.count(chunk);
                        if tokens > left {
                            return false;
                        }
                    }
                    self.cache.insert(key, tokens, 0);
                    tokens
                }
            };
            left.checked_sub(tokens).map(|l| left = l).is_some()
        };
        cached_parts(text, PART_BYTES).all(part_fits)
    }

    /// The tokens of a whole request: messages, reply priming and tool definitions.
    pub fn request(&self, request: &ChatRequest) -> usize {
        let messages = request.messages.iter().map(|m| self.message(m)).sum();
        self.request_of(messages, request.tools.get().map_or(&[], Vec::as_slice))
    }

    /// `request` of a request whose messages' tokens (`message`, each) sum to `message_tokens`.
    pub fn request_of(&self, message_tokens: usize, tools: &[Tool]) -> usize {
        message_tokens + REPLY_PRIMING + self.tools(tools)
    }

    pub fn messages(&self, messages: &[Message]) -> usize {
        messages.iter().map(|m| self.message(m)).sum::<usize>() + REPLY_PRIMING
    }

    pub fn message(&self, message: &Message) -> usize {
        let key = self.message_key(message);
        self.cached(key, || self.count_message(message))
    }

    /// The count for `key`, computed by `count` on a miss: read first from this thread's
    /// recent counts (no lock), then from the shared cache.
    fn cached(&self, key: u64, count: impl FnOnce() -> usize) -> usize {
        if let Some(count) = recent_count(key) {
            return count;
        }
        let count = self.cache.get_or_make(key, count, |_| 0);
        keep_recent_count(key, count);
        count
    }

    /// The tokens of `message` but its content's: what it counts whatever a rewrite puts in its
    /// content (its role, name, tool calls and the id of the call it answers).
    pub fn framing(&self, message: &Message) -> usize {
        let mut count = TOKENS_PER_MESSAGE + self.text(message.role.as_str());
        if let Some(name) = message.name.get() {
            count += self.text(name) + TOKENS_PER_NAME;
        }
        for call in message.tool_calls() {
            count += TOKENS_PER_MESSAGE
                + self.text(&call.function.name)
                + self.text(&call.function.arguments);
        }
        if let Some(id) = message.tool_call_id.get() {
            count += self.text(id);
        }
        count
    }

    fn count_message(&self, message: &Message) -> usize {
        let mut count = self.framing(message);
        let instructions = matches!(message.role, Role::System | Role::Developer);
        match message.content.get() {
            Some(Content::Text(text)) if instructions => count += self.instructions(text),
            Some(Content::Text(text)) => count += self.text(text),
            Some(Content::Parts(parts)) => {
                for part in parts {
                    count += match (part.kind.as_str(), part.text.get()) {
                        (_, Some(text)) => self.text(text),
                        ("image_url", None) => image_tokens(&part.extra),
                        // Audio, files…: count their JSON, an over-estimate rather than zero.
                        _ => self.text(&serde_json::to_string(&part.extra).unwrap_or_default()),
                    };
                }
            }
            None => {}
        }
        count
    }

    /// Tool definitions: name, description and the JSON of the parameters, plus framing.
    /// Cached for the whole block by its tools' keys: a request's block is counted at every
    /// stage run, and one lookup costs less than one per tool.
    pub fn tools(&self, tools: &[Tool]) -> usize {
        if tools.is_empty() {
            return 0;
        }
        let keys: Vec<u64> = tools.iter().map(|t| self.tool_key(t)).collect();
        let block = foldhash::quality::FixedState::with_seed(BLOCK_SEED).hash_one(&keys);
        self.cached(block, || {
            let counts = tools.iter().zip(&keys);
            TOOLS_FRAMING
                + counts
                    .map(|(tool, &key)| self.cached(key, || self.count_tool(tool)))
                    .sum::<usize>()
        })
    }

    pub fn tool(&self, tool: &Tool) -> usize {
        self.cached(self.tool_key(tool), || self.count_tool(tool))
    }

    fn tool_key(&self, tool: &Tool) -> u64 {
        let mut hasher = foldhash::quality::FixedState::with_seed(TOOL_SEED).build_hasher();
        self.encoding.hash(&mut hasher);
        hash_tool(tool, &mut hasher);
        hasher.finish()
    }

    fn count_tool(&self, tool: &Tool) -> usize {
        let Some(function) = &tool.function else {
            return TOKENS_PER_TOOL
                + self.text(&serde_json::to_string(&tool.extra).unwrap_or_default());
        };
        let parameters = function
            .parameters
            .get()
            .and_then(|p| p.json())
            .unwrap_or_default();
        TOKENS_PER_TOOL
            + self.text(&function.name)
            + function.description.get().map_or(0, |d| self.text(d))
            + self.text(parameters)
    }

    /// The key of a message's count: what `count_message` reads of it, in as few writes to the
    /// hasher as it takes (a message is keyed at every stage of every point a request decides).
    fn message_key(&self, message: &Message) -> u64 {
        let mut hasher = foldhash::quality::FixedState::with_seed(MESSAGE_SEED).build_hasher();
        let role = match message.role {
            Role::System => 1,
            Role::Developer => 2,
            Role::User => 3,
            Role::Assistant => 4,
            Role::Tool => 5,
            Role::Function => 6,
            Role::Other(_) => 7,
        };
        // 0 for no content, 1 for a text (keyed by its digest), 2 for parts.
        let (content, digest) = match message.content.get() {
            None => (0, 0),
            Some(Content::Text(text)) => (1, text.digest()),
            Some(Content::Parts(_)) => (2, 0),
        };
        let name = message.name.get();
        let calls = message.tool_calls();
        hasher.write_u64(
            self.encoding as u64
                | role << 1
                | content << 4
                | u64::from(message.tool_call_id.get().is_some()) << 6
                | (calls.len() as u64) << 7,
        );
        // A name by its length and bytes, a call's id (a text) by its digest.
        hasher.write_u64(name.map_or(0, |n| n.len() as u64 + 1));
        hasher.write_u64(message.tool_call_id.get().map_or(0, SharedText::digest));
        if content == 2 {
            // Parts: as every memo over messages keys them.
            hash_message(message, &mut hasher);
        } else {
            hasher.write_u64(digest);
        }
        if let Role::Other(role) = &message.role {
            hasher.write_usize(role.len());
            hasher.write(role.as_bytes());
        }
        if let Some(name) = name {
            hasher.write(name.as_bytes());
        }
        for call in calls {
            let function = &call.function;
            hasher.write_usize(function.name.len());
            hasher.write_usize(function.arguments.len());
            hasher.write(function.name.as_bytes());
            hasher.write(function.arguments.as_bytes());
        }
        hasher.finish()
    }
}

/// Feeds what a message says (role, name, content, tool calls, tool call id) to `hasher`:
/// the key of memos over messages. A text goes in as its digest, taken once per text: a
/// message is hashed again at every stage and point.
pub fn hash_message(message: &Message, hasher: &mut impl Hasher) {
    hash_message_with(message, hasher, TextBy::Digest);
}

/// `hash_message` with each text's bytes instead of its digest: for digests kept beyond the
/// process (the store's prefix states), which every version of ctxproxy must make alike.
pub fn hash_message_stored(message: &Message, hasher: &mut impl Hasher) {
    hash_message_with(message, hasher, TextBy::Bytes);
}

/// How a message's text goes into its hash.
#[derive(Clone, Copy)]
enum TextBy {
    Digest,
    Bytes,
}

fn hash_message_with(message: &Message, hasher: &mut impl Hasher, text_by: TextBy) {
    message.role.as_str().hash(hasher);
    message.name.get().hash(hasher);
    match message.content.get() {
        Some(Content::Text(text)) => {
            0u8.hash(hasher);
            match text_by {
                TextBy::Digest => text.digest().hash(hasher),
                TextBy::Bytes => text.as_str().hash(hasher),
            }
        }
        Some(Content::Parts(parts)) => {
            1u8.hash(hasher);
            for part in parts {
                part.kind.hash(hasher);
                part.text.get().hash(hasher);
                if part.text.get().is_none() {
                    serde_json::to_string(&part.extra)
                        .unwrap_or_default()
                        .hash(hasher);
                }
            }
        }
        None => 2u8.hash(hasher),
    }
    for call in message.tool_calls() {
        call.function.name.hash(hasher);
        call.function.arguments.hash(hasher);
    }
    // As the text (every version digests a stored message alike), not as its digest.
    message
        .tool_call_id
        .get()
        .map(SharedText::as_str)
        .hash(hasher);
}

pub fn hash_tool(tool: &Tool, hasher: &mut impl Hasher) {
    tool.kind.hash(hasher);
    match &tool.function {
        Some(function) => {
            function.name.hash(hasher);
            function.description.get().hash(hasher);
            if let Some(parameters) = function.parameters.get() {
                parameters.content_hash().hash(hasher);
            }
        }
        None => tool.extra.iter().for_each(|(k, v)| {
            k.hash(hasher);
            hash_json(v, hasher);
        }),
    }
}

fn image_tokens(extra: &crate::openai::Extra) -> usize {
    let detail = extra
        .get("image_url")
        .and_then(|i| i.get("detail"))
        .and_then(|d| d.as_str());
    if detail == Some("high") {
        IMAGE_HIGH_DETAIL
    } else {
        IMAGE_LOW_DETAIL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(value: serde_json::Value) -> ChatRequest {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn encodings_by_model() {
        assert_eq!(Encoding::for_model("gpt-4o-mini"), Encoding::O200kBase);
        assert_eq!(Encoding::for_model("gpt-4.1"), Encoding::O200kBase);
        assert_eq!(Encoding::for_model("o3-mini"), Encoding::O200kBase);
        assert_eq!(Encoding::for_model("gpt-5"), Encoding::O200kBase);
        assert_eq!(Encoding::for_model("gpt-4"), Encoding::Cl100kBase);
        assert_eq!(Encoding::for_model("gpt-4-turbo"), Encoding::Cl100kBase);
        assert_eq!(Encoding::for_model("gpt-3.5-turbo"), Encoding::Cl100kBase);
        assert_eq!(
            Encoding::for_model("openai/gpt-4-0613"),
            Encoding::Cl100kBase
        );
        assert_eq!(Encoding::for_model("llama-3.1-8b"), Encoding::O200kBase);
    }

    #[test]
    fn real_bpe_counts() {
        let o200k = TokenCounter::new(Encoding::O200kBase);
        let cl100k = TokenCounter::new(Encoding::Cl100kBase);
        // Values from OpenAI's tiktoken.
        assert_eq!(o200k.text("hello world"), 2);
        assert_eq!(cl100k.text("hello world"), 2);
        assert_eq!(cl100k.text("tiktoken is great!"), 6);
        assert_eq!(o200k.text(""), 0);
    }

    #[test]
    fn a_block_counts_as_its_tools_in_any_order_and_apart_from_another() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let tool = |name: &str, description: &str| -> Tool {
            serde_json::from_value(serde_json::json!({"type": "function", "function": {
                "name": name, "description": description,
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}}))
            .unwrap()
        };
        let (a, b) = (
            tool("get_order", "Gets an order."),
            tool("cancel", "Cancels it, now."),
        );
        let each =
            |tools: &[Tool]| TOOLS_FRAMING + tools.iter().map(|t| counter.tool(t)).sum::<usize>();
        for block in [
            vec![a.clone()],
            vec![a.clone(), b.clone()],
            vec![b.clone(), a.clone()],
        ] {
            assert_eq!(counter.tools(&block), each(&block));
            assert_eq!(counter.tools(&block), each(&block), "cached");
        }
        let longer = vec![a.clone(), b.clone(), b.clone()];
        assert_eq!(counter.tools(&longer), each(&longer));
        assert!(counter.tools(&longer) > counter.tools(&[a, b]));
    }

    #[test]
    fn chat_counts_follow_openai_billing() {
        let counter = TokenCounter::new(Encoding::Cl100kBase);
        let one = request(
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hello world"}]}),
        );
        // 3 per message + "user" (1) + "hello world" (2) + 3 reply priming.
        assert_eq!(counter.request(&one), 3 + 1 + 2 + 3);
        let named = request(
            json!({"model": "gpt-4", "messages": [{"role": "user", "name": "bob", "content": "hello world"}]}),
        );
        assert_eq!(counter.request(&named), 9 + counter.text("bob") + 1);
        let parts = request(
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello world"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        );
        assert_eq!(counter.request(&parts), 9 + IMAGE_LOW_DETAIL);
    }

    #[test]
    fn tool_calls_and_definitions_count() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let plain =
            request(json!({"model": "m", "messages": [{"role": "assistant", "content": null}]}));
        let with_call = request(
            json!({"model": "m", "messages": [{"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}]}),
        );
        assert!(counter.request(&with_call) > counter.request(&plain) + 5);
        let tools = request(
            json!({"model": "m", "messages": [], "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object"}}}]}),
        );
        assert!(counter.request(&tools) > TOOLS_FRAMING + TOKENS_PER_TOOL);
    }

    proptest::proptest! {
        #[test]
        fn token_ids_are_the_tokenizer_crates(
            text in "(\\PC{0,40}|[ -~\t\n]{0,80})",
        ) {
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                proptest::prop_assert_eq!(
                    encoding.encode(&text),
                    reference(encoding).encode(text.as_str())
                );
            }
        }
    }

    #[test]
    fn recent_counts_are_each_encodings_own() {
        // One thread counts the same message and text with both encodings, alternately: each
        // read from the recent counts must be the encoding's own count.
        let text = "Ñandú 東京 ".repeat(200);
        let message = Message::text(Role::User, text.clone());
        let counters = [
            TokenCounter::new(Encoding::O200kBase),
            TokenCounter::new(Encoding::Cl100kBase),
        ];
        for _ in 0..3 {
            for counter in &counters {
                let reference = reference(counter.encoding());
                assert_eq!(counter.text(&text), reference.count(&text));
                assert_eq!(
                    counter.message(&message),
                    TOKENS_PER_MESSAGE + reference.count("user") + reference.count(&text)
                );
            }
        }
        assert_ne!(counters[0].text(&text), counters[1].text(&text));
    }

    #[test]
    fn a_message_key_tells_apart_everything_the_count_reads() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let message = |value: serde_json::Value| -> Message {
            serde_json::from_value(value).expect("a message")
        };
        let call = |name: &str, arguments: &str| {
            serde_json::json!([{"id": "c1", "type": "function",
                "function": {"name": name, "arguments": arguments}}])
        };
        let variants = [
            message(serde_json::json!({"role": "user", "content": "ab"})),
            message(serde_json::json!({"role": "assistant", "content": "ab"})),
            message(serde_json::json!({"role": "critic", "content": "ab"})),
            message(serde_json::json!({"role": "critics", "content": "ab"})),
            message(serde_json::json!({"role": "user", "content": "abc"})),
            message(serde_json::json!({"role": "user", "content": "ab", "name": "x"})),
            message(
                serde_json::json!({"role": "user", "content": [{"type": "text", "text": "ab"}]}),
            ),
            message(serde_json::json!({"role": "user"})),
            message(serde_json::json!({"role": "tool", "content": "ab", "tool_call_id": "x"})),
            message(serde_json::json!({"role": "tool", "content": "ab", "tool_call_id": "xy"})),
            message(serde_json::json!({"role": "assistant", "tool_calls": call("f", "{}")})),
            message(serde_json::json!({"role": "assistant", "tool_calls": call("f{", "}")})),
            message(serde_json::json!({"role": "assistant", "tool_calls": call("g", "{}")})),
        ];
        let keys: std::collections::HashSet<u64> =
            variants.iter().map(|m| counter.message_key(m)).collect();
        assert_eq!(keys.len(), variants.len());
        for variant in &variants {
            assert_eq!(
                counter.message_key(variant),
                counter.message_key(&variant.clone())
            );
        }
        let cl100k = TokenCounter::new(Encoding::Cl100kBase);
        assert_ne!(
            counter.message_key(&variants[0]),
            cl100k.message_key(&variants[0])
        );
    }

    #[test]
    fn piece_cache_counts_like_the_tokenizer() {
        let texts = [
            "Hello, world! The reservation ABC123 is confirmed.",
            "¿Dónde está el aeropuerto? Ñandú, café, 東京, emoji 🚀🚀 and  spaces\n\n\tend",
            "{\"id\": 42, \"url\": \"https://api.github.com/repos/a/b\", \"x\": [1,2,3]}",
            &"supercalifragilisticexpialidocious antidisestablishmentarianism ".repeat(20),
            "",
            "a",
        ];
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for _ in 0..2 {
                for text in texts {
                    assert_eq!(
                        encoding.count(text),
                        reference(encoding).count(text),
                        "{text}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_two_byte_piece_counts_as_the_tokenizer_counts_it() {
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for _ in 0..2 {
                for first in b' '..=b'~' {
                    for second in b' '..=b'~' {
                        let text = String::from_utf8(vec![first, second]).unwrap();
                        assert_eq!(
                            encoding.count(&text),
                            reference(encoding).count(&text),
                            "{text}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_text_fits_exactly_when_its_count_is_within_the_limit() {
        let row = |k: usize| {
            format!(
                r#"{{"id":{k},"title":"Fix  the parser's   edge case #{k}","user":"octo cat","labels":["bug","p{k}"],"body":"Steps:\n1. run it\n2. see"}}"#
            )
        };
        let json = format!("[{}]", (0..90).map(row).collect::<Vec<_>>().join(","));
        let texts = [
            json.clone(),
            json[..1_500].to_owned(),
            "no spaces at all,".repeat(300),
            "Lines of prose, some  with double spaces.\n  And indents \r\n".repeat(120),
            "¿Dónde está? Ñandú, café, 東京 🚀 ".repeat(80),
            "short".to_owned(),
        ];
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            for text in &texts {
                let tokens = reference(encoding).count(text.as_str());
                let chunks: usize = pretokenize::chunks_at_spaces(text, FITS_CHUNK_BYTES)
                    .map(|chunk| reference(encoding).count(chunk))
                    .sum();
                assert_eq!(chunks, tokens, "the chunks of {text}");
                for limit in [0, tokens / 3, tokens - 1, tokens, tokens + 1, 10 * tokens] {
                    // A fresh cache, then one holding the parts counted whole.
                    let counter = TokenCounter::new(encoding);
                    assert_eq!(counter.fits(text, limit), tokens <= limit, "{limit} {text}");
                    assert_eq!(counter.fits(text, limit), tokens <= limit, "{limit} {text}");
                    assert_eq!(counter.text(text), tokens);
                    assert_eq!(counter.fits(text, limit), tokens <= limit, "{limit} {text}");
                }
            }
        }
    }

    #[test]
    fn instructions_count_as_the_whole_text() {
        let ledger: String = (0..60)
            .map(|k| {
                format!("- call get_order(order_id: #W{k:07}) -> status: shipped, total: {k}.50\n")
            })
            .collect();
        let texts = [
            "You are an airline agent.\n\n  Verify the user first.\r\n".repeat(40),
            format!(
                "Policy.\n<conversation_summary>\nIdentifiers from earlier turns, word for word:\n{ledger}Earlier turns, oldest first:\n- turns 1-3: refund\n</conversation_summary>"
            ),
            "no line breaks at all, ".repeat(60),
        ];
        for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
            let counter = TokenCounter::new(encoding);
            for text in &texts {
                assert!(text.len() >= 2 * INSTRUCTION_PART_BYTES);
                assert_eq!(counter.instructions(text), reference(encoding).count(text));
                // Again, from the cached parts.
                assert_eq!(counter.instructions(text), reference(encoding).count(text));
            }
        }
    }

    #[test]
    fn no_two_pieces_pack_alike() {
        let mut seen = std::collections::HashMap::new();
        let bytes = [b'a', b'b', 0, 0xff];
        // Every piece of up to 9 bytes over four bytes (a zero among them), and longer ones
        // that differ in one byte or in length only.
        let mut pieces: Vec<Vec<u8>> = vec![Vec::new()];
        for length in 1..=9 {
            let mut next = Vec::new();
            for piece in pieces.iter().filter(|p| p.len() == length - 1) {
                for b in bytes {
                    let mut longer = piece.clone();
                    longer.push(b);
                    next.push(longer);
                }
            }
            pieces.extend(next);
        }
        for length in 10..=PACKED_MAX_BYTES {
            for at in 0..length {
                for b in bytes {
                    let mut piece = vec![b'a'; length];
                    piece[at] = b;
                    pieces.push(piece);
                }
            }
        }
        pieces.sort();
        pieces.dedup();
        for piece in &pieces {
            let key = packed(piece).unwrap();
            assert_eq!(seen.insert(key, piece.clone()), None, "{piece:?}");
        }
        assert_eq!(packed(&[b'x'; PACKED_MAX_BYTES + 1]), None);
    }

    #[test]
    fn cached_counts_equal_fresh_counts() {
        let counter = TokenCounter::new(Encoding::O200kBase);
        let message: Message =
            serde_json::from_value(json!({"role": "user", "content": "The same text, twice."}))
                .unwrap();
        let first = counter.message(&message);
        assert_eq!(counter.message(&message), first);
        assert_eq!(counter.count_message(&message), first);
    }
}
