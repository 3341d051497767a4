//! The Redis store, single node (an auto-reconnecting `ConnectionManager`, connected lazily)
//! or Cluster (connected on first use, reconnecting by itself afterwards).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use super::config::StoreConfig;
use super::{Backend, StoreError};

enum Connection {
    Single(ConnectionManager),
    Cluster(Box<Cluster>),
}

struct Cluster {
    client: ClusterClient,
    connection: OnceCell<ClusterConnection>,
}

pub struct RedisBackend {
    connection: Connection,
}

/// Delays of the connection manager's own reconnect attempts.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(2);

impl RedisBackend {
    /// Builds the client without connecting: a proxy starts even when Redis is down.
    pub fn new(config: &StoreConfig) -> Result<RedisBackend, StoreError> {
        let timeout = Duration::from_millis(config.op_timeout_ms);
        let connection = if config.cluster_urls.is_empty() {
            let client = redis::Client::open(config.redis_url.as_str())?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout.max(Duration::from_millis(200))))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_min_delay(RECONNECT_MIN_DELAY)
                .set_max_delay(RECONNECT_MAX_DELAY);
            Connection::Single(ConnectionManager::new_lazy_with_config(
                client,
                manager_config,
            )?)
        } else {
            let client = ClusterClient::builder(config.cluster_urls.iter().map(String::as_str))
                .connection_timeout(timeout.max(Duration::from_millis(200)))
                .response_timeout(timeout)
                .build()?;
            Connection::Cluster(Box::new(Cluster {
                client,
                connection: OnceCell::new(),
            }))
        };
        Ok(RedisBackend { connection })
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        match &self.connection {
            Connection::Single(manager) => Ok(cmd.query_async(&mut manager.clone()).await?),
            Connection::Cluster(cluster) => {
                let connection = cluster
                    .connection
                    .get_or_try_init(|| cluster.client.get_async_connection())
                    .await?;
                Ok(cmd.query_async(&mut connection.clone()).await?)
            }
        }
    }

    async fn pipeline(&self, pipe: &redis::Pipeline) -> Result<(), StoreError> {
        match &self.connection {
            Connection::Single(manager) => Ok(pipe.exec_async(&mut manager.clone()).await?),
            Connection::Cluster(cluster) => {
                let connection = cluster
                    .connection
                    .get_or_try_init(|| cluster.client.get_async_connection())
                    .await?;
                Ok(pipe.exec_async(&mut connection.clone()).await?)
            }
        }
    }
}

fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Backend for RedisBackend {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.query(redis::cmd("GET").arg(key)).await
    }

    async fn set(&self, key: &str, value: &[u8], ttl: Duration) -> Result<(), StoreError> {
        self.query(
            redis::cmd("SET")
                .arg(key)
                .arg(value)
                .arg("PX")
                .arg(millis(ttl)),
        )
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.query(redis::cmd("DEL").arg(key)).await
    }

    async fn push_capped(
        &self,
        key: &str,
        value: &[u8],
        max_len: usize,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("LPUSH")
            .arg(key)
            .arg(value)
            .cmd("LTRIM")
            .arg(key)
            .arg(0)
            .arg(max_len.saturating_sub(1))
            .cmd("PEXPIRE")
            .arg(key)
            .arg(millis(ttl));
        self.pipeline(&pipe).await
    }

    async fn list(&self, key: &str) -> Result<Vec<Vec<u8>>, StoreError> {
        self.query(redis::cmd("LRANGE").arg(key).arg(0).arg(-1))
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.query::<String>(&redis::cmd("PING")).await.map(drop)
    }
}
