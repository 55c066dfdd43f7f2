// Node.js amqplib (callback API), as a user writes it: an exclusive server-named queue,
// sendToQueue until it returns false (the socket's buffer is full), then connection.close.
// amqplib writes connection.close ahead of publishes still in its buffer; the close callback
// must fire (the broker must not reset the socket under those writes).
const amqp = require('amqplib/callback_api');
const url = process.argv[2];
const done = (result) => { console.log(JSON.stringify(result)); process.exit(0); };
setTimeout(() => done({ timeout: true }), 15000);
amqp.connect(url, (err, conn) => {
  if (err) return done({ error: 'connect: ' + err.message });
  conn.on('error', (e) => console.log('connection error event: ' + e.message));
  conn.createChannel((err, ch) => {
    if (err) return done({ error: 'channel: ' + err.message });
    ch.assertQueue('', { exclusive: true }, (err, ok) => {
      if (err) return done({ error: 'assertQueue: ' + err.message });
      let sent = 1;
      while (ch.sendToQueue(ok.queue, Buffer.from('hello ' + sent))) sent++;
      const t0 = Date.now();
      conn.close((err) => done({ sent, closed: !err, error: err ? err.message : null, ms: Date.now() - t0 }));
    });
  });
});
