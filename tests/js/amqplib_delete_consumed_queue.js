// Node.js amqplib (promise API): consume a queue, then delete it on the same channel.
// amqplib's consumer gets null on basic.cancel; a cancel that overtakes delete-ok makes
// deleteQueue() reject ("Channel ended, no reply will be forthcoming") when the app then closes
// the channel, as apps do on a null message.
const amqp = require('amqplib');
const [url, queue] = process.argv.slice(2);
const done = (result) => { console.log(JSON.stringify(result)); process.exit(0); };
setTimeout(() => done({ timeout: true }), 15000);
(async () => {
  const conn = await amqp.connect(url);
  const ch = await conn.createChannel();
  await ch.assertQueue(queue);
  const events = [];
  await ch.consume(queue, (msg) => {
    if (msg === null) {
      events.push('cancelled');
      ch.close().catch(() => {});
    } else {
      events.push('message');
    }
  });
  let deleted = null;
  let error = null;
  try {
    deleted = await ch.deleteQueue(queue);
    events.push('delete-ok');
  } catch (e) {
    error = e.message;
  }
  // the cancel (after delete-ok) arrives within a moment
  for (let i = 0; i < 100 && !events.includes('cancelled'); i++) await new Promise((r) => setTimeout(r, 20));
  await conn.close().catch(() => {});
  done({ deleted, error, events });
})().catch((e) => done({ error: 'unexpected: ' + e.message }));
