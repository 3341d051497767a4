//! Token counting with the real OpenAI BPE vocabularies (o200k_base, cl100k_base), the way
//! OpenAI bills a chat request: per-message overhead, role, name, content parts, tool calls,
//! and tool definitions.
//!
//! Per-message counts are cached by a hash of what is counted, so a long history is not
//! re-tokenized on every turn. The cache is a memo: it never changes a result.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use bpe_openai::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::openai::{ChatRequest, Content, Message, Tool};

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
/// Entries kept in the per-message cache before it is cleared.
const CACHE_CAPACITY: usize = 100_000;

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
        let model = model.rsplit('/').next().unwrap_or(model).to_ascii_lowercase();
        let cl100k = model == "gpt-4"
            || ["gpt-4-", "gpt-3.5", "gpt-35", "text-embedding-3", "text-embedding-ada"]
                .iter()
                .any(|prefix| model.starts_with(prefix));
        if cl100k { Encoding::Cl100kBase } else { Encoding::O200kBase }
    }

    fn tokenizer(self) -> &'static Tokenizer {
        match self {
            Encoding::O200kBase => bpe_openai::o200k_base(),
            Encoding::Cl100kBase => bpe_openai::cl100k_base(),
        }
    }
}

/// Counts tokens for one encoding, with the per-message cache.
pub struct TokenCounter {
    encoding: Encoding,
    cache: Mutex<HashMap<u64, usize>>,
}

impl TokenCounter {
    pub fn new(encoding: Encoding) -> Self {
        TokenCounter {
            encoding,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    pub fn text(&self, text: &str) -> usize {
        if text.is_empty() {
            return 0;
        }
        self.encoding.tokenizer().count(text)
    }

    /// The tokens of a whole request: messages, reply priming and tool definitions.
    pub fn request(&self, request: &ChatRequest) -> usize {
        self.messages(&request.messages) + self.tools(request.tools.get().map_or(&[], Vec::as_slice))
    }

    pub fn messages(&self, messages: &[Message]) -> usize {
        messages.iter().map(|m| self.message(m)).sum::<usize>() + REPLY_PRIMING
    }

    pub fn message(&self, message: &Message) -> usize {
        let key = self.message_key(message);
        if let Ok(cache) = self.cache.lock() {
            if let Some(&count) = cache.get(&key) {
                return count;
            }
        }
        let count = self.count_message(message);
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= CACHE_CAPACITY {
                cache.clear();
            }
            cache.insert(key, count);
        }
        count
    }

    fn count_message(&self, message: &Message) -> usize {
        let mut count = TOKENS_PER_MESSAGE + self.text(message.role.as_str());
        if let Some(name) = message.name.get() {
            count += self.text(name) + TOKENS_PER_NAME;
        }
        match message.content.get() {
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
        for call in message.tool_calls() {
            count += TOKENS_PER_MESSAGE + self.text(&call.function.name) + self.text(&call.function.arguments);
        }
        if let Some(id) = message.tool_call_id.get() {
            count += self.text(id);
        }
        count
    }

    /// Tool definitions: name, description and the JSON of the parameters, plus framing.
    pub fn tools(&self, tools: &[Tool]) -> usize {
        if tools.is_empty() {
            return 0;
        }
        TOOLS_FRAMING + tools.iter().map(|t| self.tool(t)).sum::<usize>()
    }

    pub fn tool(&self, tool: &Tool) -> usize {
        let Some(function) = &tool.function else {
            return TOKENS_PER_TOOL + self.text(&serde_json::to_string(&tool.extra).unwrap_or_default());
        };
        let parameters = function
            .parameters
            .get()
            .map(|p| serde_json::to_string(p).unwrap_or_default())
            .unwrap_or_default();
        TOKENS_PER_TOOL
            + self.text(&function.name)
            + function.description.get().map_or(0, |d| self.text(d))
            + self.text(&parameters)
    }

    fn message_key(&self, message: &Message) -> u64 {
        let mut hasher = std::hash::DefaultHasher::new();
        self.encoding.hash(&mut hasher);
        message.role.as_str().hash(&mut hasher);
        message.name.get().hash(&mut hasher);
        match message.content.get() {
            Some(Content::Text(text)) => {
                0u8.hash(&mut hasher);
                text.hash(&mut hasher);
            }
            Some(Content::Parts(parts)) => {
                1u8.hash(&mut hasher);
                for part in parts {
                    part.kind.hash(&mut hasher);
                    part.text.get().hash(&mut hasher);
                    if part.text.get().is_none() {
                        serde_json::to_string(&part.extra).unwrap_or_default().hash(&mut hasher);
                    }
                }
            }
            None => 2u8.hash(&mut hasher),
        }
        for call in message.tool_calls() {
            call.function.name.hash(&mut hasher);
            call.function.arguments.hash(&mut hasher);
        }
        message.tool_call_id.get().hash(&mut hasher);
        hasher.finish()
    }
}

fn image_tokens(extra: &crate::openai::Extra) -> usize {
    let detail = extra
        .get("image_url")
        .and_then(|i| i.get("detail"))
        .and_then(|d| d.as_str());
    if detail == Some("high") { IMAGE_HIGH_DETAIL } else { IMAGE_LOW_DETAIL }
}
