#!/bin/sh
# Write server.properties from the KAFKA_* environment (KAFKA_LOG_DIRS -> log.dirs; '__'
# stands for '_' and '___' for '-', as in the apache/kafka image), format the storage
# with $CLUSTER_ID on first start, then run the broker in the foreground.
set -eu
conf=/opt/kafka/server.properties
: > "$conf"
env | grep '^KAFKA_' | grep -v '_OPTS=' | while IFS='=' read -r name value; do
    key=$(printf '%s' "${name#KAFKA_}" | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g' \
          | tr 'A-Z' 'a-z')
    printf '%s=%s\n' "$key" "$value" >> "$conf"
done
grep -q '^log.dirs=' "$conf" || echo "log.dirs=/var/lib/kafka/data" >> "$conf"
set -f  # the class path's '*' is for java, not for the shell
java="java ${KAFKA_HEAP_OPTS:--Xmx768m} -XX:+UseG1GC -Djava.awt.headless=true
      -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties -cp /opt/kafka/libs/*"
data=$(sed -n 's/^log.dirs=//p' "$conf")
if [ ! -f "$data/meta.properties" ]; then
    $java kafka.tools.StorageTool format --cluster-id="${CLUSTER_ID:?set CLUSTER_ID}" -c "$conf" >/dev/null
fi
exec $java kafka.Kafka "$conf"
